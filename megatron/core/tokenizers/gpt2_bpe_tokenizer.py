"""GPT-2's byte-level BPE from a `vocab.json` + `merges.txt` pair (`--tokenizer-type GPT2BPETokenizer`)."""

import json
import os
from typing import List

from megatron.core.tokenizers.megatron_tokenizer import DictVocabTokenizer
from megatron.core.tokenizers.optional_imports import import_optional

END_OF_TEXT = "<|endoftext|>"


def _require_file(path, flag: str) -> str:
    if path is None:
        raise ValueError(f"GPT2BPETokenizer needs {flag} (a GPT-2 style {flag[2:].replace('-', '.')})")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")
    return str(path)


class GPT2BPETokenizer(DictVocabTokenizer):
    """GPT-2's tokenizer: byte-level BPE with GPT-2's pre-tokenization regex and no prefix space.

    Implemented with the `tokenizers` library. As in GPT-2 and Megatron-LM, `<|endoftext|>` written in the input
    text is tokenized as ordinary text; only its id, taken from `vocab.json`, is the end-of-document token.
    Decoding replaces invalid UTF-8 byte sequences with U+FFFD.
    """

    def __init__(self, vocab_file, merge_file):
        vocab_file = _require_file(vocab_file, "--vocab-file")
        merge_file = _require_file(merge_file, "--merge-file")
        super().__init__(vocab_file, merge_file)
        tokenizers = import_optional("tokenizers", "tokenizers", "GPT2BPETokenizer")
        try:
            with open(vocab_file, encoding="utf-8") as file:
                self._vocab = json.load(file)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json ({error})") from None
        if not isinstance(self._vocab, dict) or END_OF_TEXT not in self._vocab:
            raise ValueError(
                f"--vocab-file {vocab_file}: the vocabulary has no {END_OF_TEXT!r} entry, which GPT2BPETokenizer "
                f"uses as the end-of-document token"
            )
        try:
            model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:  # the Rust loader reports bad files as plain Exceptions
            raise ValueError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: cannot load ({error})") from None
        self._tokenizer = tokenizers.Tokenizer(model)
        self._tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = tokenizers.decoders.ByteLevel()
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}
        self._eod_id = self._vocab[END_OF_TEXT]

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: List[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def bos(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eod_id
