"""`--tokenizer-type TikTokenizer`: a BPE vocabulary run by the `tiktoken` library, laid out as Megatron-LM does.

Ids `0 .. num_special_tokens-1` are special tokens (`<unk>`, `<s>`, `</s>`, then any `--tiktoken-special-tokens`,
then `<SPECIAL_k>` fillers); the file's BPE ranks follow, shifted by `num_special_tokens` and cut so that the whole
vocabulary has `vocab_size` ids (default 2**17). Text is encoded without special-token parsing, so `</s>` in the
input is ordinary text; `eod` is the `</s>` id.

The vocabulary file is read from local disk, in either format:
- `.json`: Megatron-LM's list of `{"rank": i, "token_bytes": <base64>, "token_str": ...}`, rank i at position i;
- otherwise tiktoken's own `.tiktoken` text format: one `<base64 token bytes> <rank>` per line.
"""

import base64
import binascii
import json
import os
from typing import Dict, List, Optional

from megatron.core.tokenizers.base_tokenizer import UNDEFINED_TOKEN_ID
from megatron.core.tokenizers.megatron_tokenizer import DictVocabTokenizer
from megatron.core.tokenizers.optional_imports import import_optional

# `--tiktoken-pattern v1` and `v2`: the pre-tokenization regexes Megatron-LM names so.
PATTERN_TIKTOKEN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_TIKTOKEN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TIKTOKEN_PATTERNS = {"v1": PATTERN_TIKTOKEN_V1, "v2": PATTERN_TIKTOKEN_V2}
DEFAULT_TIKTOKEN_VOCAB_SIZE = 2**17
DEFAULT_NUM_SPECIAL_TOKENS = 1000
REQUIRED_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def load_mergeable_ranks(path: str, max_vocab: Optional[int] = None) -> Dict[bytes, int]:
    """Token bytes -> BPE rank from a `.json` (Megatron-LM) or `.tiktoken` file, keeping ranks below `max_vocab`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model {path}: no such file")
    ranks = _read_json_ranks(path) if str(path).endswith(".json") else _read_tiktoken_ranks(path)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"--tokenizer-model {path}: ranks must be 0..{len(ranks) - 1}, each once")
    if max_vocab is not None:
        ranks = {token: rank for token, rank in ranks.items() if rank < max_vocab}
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        raise ValueError(
            f"--tokenizer-model {path}: {len(missing)} single bytes (first {missing[0]}) have no rank among the "
            f"{len(ranks)} kept; a byte-level BPE needs all 256 (raise --vocab-size if the file has them)"
        )
    return ranks


def _read_json_ranks(path: str) -> Dict[bytes, int]:
    try:
        with open(path, encoding="utf-8") as file:
            entries = json.load(file)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--tokenizer-model {path}: not a JSON vocabulary ({error})") from None
    if not isinstance(entries, list):
        raise ValueError(f"--tokenizer-model {path}: expected a JSON list of {{rank, token_bytes, token_str}}")
    ranks = {}
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("rank") != position or "token_bytes" not in entry:
            raise ValueError(
                f'--tokenizer-model {path}: entry {position} must be {{"rank": {position}, '
                f'"token_bytes": <base64>, ...}}'
            )
        ranks[_b64(entry["token_bytes"], path, f"entry {position}")] = position
    return ranks


def _read_tiktoken_ranks(path: str) -> Dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            fields = line.split()
            if len(fields) != 2 or not fields[1].isdigit():
                raise ValueError(f"--tokenizer-model {path}:{line_number}: expected '<base64 token> <rank>'")
            ranks[_b64(fields[0], path, f"line {line_number}")] = int(fields[1])
    return ranks


def _b64(text, path: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError(f"--tokenizer-model {path}: {where}: token bytes are not valid base64") from None


class TikTokenizer(DictVocabTokenizer):
    """A tiktoken BPE with Megatron-LM's special-token layout (see the module docstring)."""

    def __init__(
        self,
        path,
        pattern: str = PATTERN_TIKTOKEN_V2,
        vocab_size: Optional[int] = None,
        num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
        special_tokens: Optional[List[str]] = None,
    ):
        if path is None:
            raise ValueError("TikTokenizer needs --tokenizer-model (a .tiktoken or Megatron .json vocabulary)")
        vocab_size = DEFAULT_TIKTOKEN_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        special_tokens = list(REQUIRED_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        super().__init__(
            path,
            pattern=pattern,
            vocab_size=vocab_size,
            num_special_tokens=num_special_tokens,
            special_tokens=special_tokens,
        )
        _check_special_tokens(special_tokens, num_special_tokens, vocab_size)
        tiktoken = import_optional("tiktoken", "tiktoken", "TikTokenizer")
        ranks = load_mergeable_ranks(str(path), max_vocab=vocab_size - num_special_tokens)

        fillers = [f"<SPECIAL_{i}>" for i in range(len(special_tokens), num_special_tokens)]
        self._special_ids = {token: i for i, token in enumerate(special_tokens + fillers)}
        self._special_by_id = {i: token for token, i in self._special_ids.items()}
        shifted_ranks = {token: rank + num_special_tokens for token, rank in ranks.items()}
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(str(path)),
            pat_str=pattern,
            mergeable_ranks=shifted_ranks,
            special_tokens={},  # special tokens are never parsed from text; their ids are handled here
        )
        self._vocab_size = vocab_size
        self._vocab = {**self._special_ids, **shifted_ranks}
        self._inv_vocab = {i: token for token, i in self._vocab.items()}

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> List[int]:
        ids = self._encoding.encode_ordinary(text)
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])

    def detokenize(self, ids: List[int]) -> str:
        """Decode; special ids become their token text, invalid UTF-8 becomes U+FFFD."""
        pieces = []
        for token_id in (int(i) for i in ids):
            if token_id in self._special_by_id:
                pieces.append(self._special_by_id[token_id].encode("utf-8"))
            elif token_id in self._inv_vocab:
                pieces.append(self._inv_vocab[token_id])
            else:
                raise ValueError(f"TikTokenizer: id {token_id} is not in the vocabulary (size {self.vocab_size})")
        return b"".join(pieces).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> Dict:
        """Special token text (str) or BPE token bytes (bytes) -> id."""
        return self._vocab

    @property
    def bos(self) -> int:
        return self._special_ids["<s>"]

    @property
    def eos(self) -> int:
        return self._special_ids["</s>"]

    @property
    def eod(self) -> int:
        return self._special_ids["</s>"]

    @property
    def unk(self) -> int:
        return self._special_ids["<unk>"]

    @property
    def pad(self) -> int:
        return self._special_ids.get("<pad>", UNDEFINED_TOKEN_ID)


def _check_special_tokens(special_tokens: List[str], num_special_tokens: int, vocab_size: int) -> None:
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"--tiktoken-special-tokens {special_tokens}: each token may appear only once")
    missing = [token for token in REQUIRED_SPECIAL_TOKENS if token not in special_tokens]
    if missing:
        raise ValueError(f"--tiktoken-special-tokens must include {REQUIRED_SPECIAL_TOKENS}; missing {missing}")
    if not len(special_tokens) <= num_special_tokens:
        raise ValueError(
            f"--tiktoken-num-special-tokens {num_special_tokens} is less than the {len(special_tokens)} "
            f"special tokens given"
        )
    if not num_special_tokens + 256 <= vocab_size:
        raise ValueError(
            f"--vocab-size {vocab_size} leaves no room for the {num_special_tokens} special tokens and the 256 "
            f"byte tokens; pass a larger --vocab-size (default {DEFAULT_TIKTOKEN_VOCAB_SIZE})"
        )
