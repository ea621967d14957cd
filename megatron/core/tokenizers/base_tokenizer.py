"""`MegatronTokenizerBase`: the interface every tokenizer in `megatron.core.tokenizers` implements (Megatron-Core
0.19's name for it)."""

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Dict, List

# The id a tokenizer reports for a special token it does not define (as Megatron-LM's tokenizers do for cls/sep/mask).
UNDEFINED_TOKEN_ID = -1


class MegatronTokenizerBase(ABC):
    """Abstract tokenizer: text <-> token ids, plus the special ids the datasets need.

    `unique_identifiers` is an OrderedDict naming the class, the tokenizer files and the options; datasets put it in
    their cache descriptions, so two tokenizers with the same identifiers must tokenize identically.
    Special ids a tokenizer does not define are reported as -1.
    """

    def __init__(self, *tokenizer_paths: str, **tokenizer_options):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [str(path) for path in tokenizer_paths]
        for name, value in tokenizer_options.items():
            self.unique_identifiers[name] = str(value)

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Token ids of `text`."""

    @abstractmethod
    def detokenize(self, ids: List[int]) -> str:
        """The text of token ids."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (before padding for tensor parallelism)."""

    @property
    @abstractmethod
    def vocab(self) -> Dict:
        """Token -> id."""

    @property
    @abstractmethod
    def inv_vocab(self) -> Dict:
        """Id -> token."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """The end-of-document id that `--append-eod` appends and the datasets mask on."""

    @property
    def pad(self) -> int:
        """The padding id, or -1 when the tokenizer has none (datasets then pad with -1 and mask it out)."""
        return UNDEFINED_TOKEN_ID

    @property
    def bos(self) -> int:
        """The beginning-of-sequence id, or -1."""
        return UNDEFINED_TOKEN_ID

    @property
    def eos(self) -> int:
        """The end-of-sequence id, or -1."""
        return UNDEFINED_TOKEN_ID

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"
