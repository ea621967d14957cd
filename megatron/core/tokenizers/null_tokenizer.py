"""`--tokenizer-type NullTokenizer`: the text is already token ids, written as space-separated integers."""

from typing import Dict, List

from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Ids as text, for data that is already tokenized and for benchmarks.

    As in Megatron-LM, `--vocab-size V` gives ids 0..V-1 for the data plus the end-of-document id V, so
    `vocab_size` is V + 1 and `eod` is `vocab_size - 1`.
    """

    def __init__(self, vocab_size):
        try:
            data_vocab_size = int(vocab_size)
        except (TypeError, ValueError):
            raise ValueError(f"NullTokenizer needs --vocab-size as an integer, got {vocab_size!r}") from None
        if data_vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {data_vocab_size}")
        super().__init__(vocab_size=data_vocab_size)
        self._eod_id = data_vocab_size

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads space-separated integer ids, got {text[:40]!r}") from None
        out_of_range = [token_id for token_id in ids if not 0 <= token_id < self.vocab_size]
        if out_of_range:
            raise ValueError(
                f"NullTokenizer: ids {out_of_range[:5]} are outside [0, {self.vocab_size}); raise --vocab-size"
            )
        return ids

    def detokenize(self, ids: List[int]) -> str:
        return " ".join(str(int(token_id)) for token_id in ids)

    @property
    def vocab_size(self) -> int:
        return self._eod_id + 1

    @property
    def vocab(self) -> Dict[str, int]:
        return {str(token_id): token_id for token_id in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {token_id: str(token_id) for token_id in range(self.vocab_size)}

    @property
    def eod(self) -> int:
        return self._eod_id
