"""`MegatronTokenizer`: the class every built tokenizer here is an instance of, under the name Megatron-Core code
annotates tokenizers with (`megatron.core.tokenizers.MegatronTokenizer`)."""

from typing import Dict

from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase


class MegatronTokenizer(MegatronTokenizerBase):
    """A text tokenizer with the :class:`MegatronTokenizerBase` interface; the tokenizer classes derive from it, so
    ``isinstance(tokenizer, MegatronTokenizer)`` holds for whatever ``build_tokenizer`` returns."""


class DictVocabTokenizer(MegatronTokenizer):
    """A tokenizer that keeps its vocabulary as the dicts `self._vocab` (token -> id) and `self._inv_vocab`."""

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict:
        return self._inv_vocab
