"""SentencePiece models (`.model` files): `SentencePieceTokenizer`, `GPTSentencePieceTokenizer`, `Llama2Tokenizer`."""

import os
import re
from typing import Dict, List

from megatron.core.tokenizers.megatron_tokenizer import DictVocabTokenizer
from megatron.core.tokenizers.optional_imports import import_optional


def _load_processor(model_file, tokenizer_type: str):
    if model_file is None:
        raise ValueError(f"{tokenizer_type} needs --tokenizer-model (a SentencePiece .model file)")
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"--tokenizer-model {model_file}: no such file")
    sentencepiece = import_optional("sentencepiece", "sentencepiece", tokenizer_type)
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    except (OSError, RuntimeError) as error:
        raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model ({error})") from None


def _piece_or(processor, piece_id: int, fallback: str) -> str:
    """The piece of a special id, or `fallback` when the model does not define that id (id -1)."""
    if 0 <= piece_id < processor.get_piece_size():
        return processor.id_to_piece(piece_id)
    return fallback


class _SentencePieceBase(DictVocabTokenizer):
    """A SentencePiece model with its pieces as the vocabulary."""

    def __init__(self, model_file, tokenizer_type: str, **options):
        self._processor = _load_processor(model_file, tokenizer_type)
        super().__init__(model_file, **options)
        self._vocab = {self._processor.id_to_piece(i): i for i in range(self._processor.get_piece_size())}
        self._inv_vocab = {i: piece for piece, i in self._vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return self._processor.encode(text, out_type=int)

    def detokenize(self, ids: List[int]) -> str:
        return self._processor.decode([int(i) for i in ids])

    @property
    def pad(self) -> int:
        return self._processor.pad_id()

    @property
    def bos(self) -> int:
        return self._processor.bos_id()

    @property
    def eos(self) -> int:
        return self._processor.eos_id()

    @property
    def eod(self) -> int:
        return self._processor.eos_id()


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """A SentencePiece model used as is: `eod` is the model's `</s>` id, no ids are added."""

    def __init__(self, model_file):
        super().__init__(model_file, "GPTSentencePieceTokenizer")


class Llama2Tokenizer(_SentencePieceBase):
    """Llama 2's tokenizer: `tokenize` puts the model's BOS id first (as Megatron-LM's, so preprocessed documents
    start with BOS); `eod` is the EOS id."""

    def __init__(self, model_file):
        super().__init__(model_file, "Llama2Tokenizer")

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        ids = self._processor.encode(text, out_type=int)
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])


class SentencePieceTokenizer(_SentencePieceBase):
    """Megatron-LM's general SentencePiece tokenizer, with special tokens added to the model's vocabulary.

    After the model's pieces come, when the model lacks them, `<CLS>`, `<SEP>`, `<EOD>`, `<MASK>` and the
    pad/BOS/EOS pieces (`<PAD>`, `<BOS>`, `<EOS>` if the model defines no such id), then `vocab_extra_ids`
    sentinels `<extra_id_0>`, ... Special tokens written in the text map to their ids; `eod` is `<EOD>`.
    """

    def __init__(self, model_file, vocab_extra_ids: int = 0):
        super().__init__(model_file, "SentencePieceTokenizer", vocab_extra_ids=vocab_extra_ids)
        self._special_ids: Dict[str, int] = {}
        self._cls_id = self._add_special_token("<CLS>")
        self._sep_id = self._add_special_token("<SEP>")
        self._eod_id = self._add_special_token("<EOD>")
        self._mask_id = self._add_special_token("<MASK>")
        processor = self._processor
        self._pad_id = self._add_special_token(_piece_or(processor, processor.pad_id(), "<PAD>"))
        self._bos_id = self._add_special_token(_piece_or(processor, processor.bos_id(), "<BOS>"))
        self._eos_id = self._add_special_token(_piece_or(processor, processor.eos_id(), "<EOS>"))
        self._extra_ids = [self._add_special_token(f"<extra_id_{i}>") for i in range(int(vocab_extra_ids))]
        self._special_by_id = {token_id: token for token, token_id in self._special_ids.items()}
        # Longest first, so a special token that contains another one wins.
        alternatives = sorted(self._special_ids, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(re.escape(token) for token in alternatives))

    def _add_special_token(self, token: str) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        self._special_ids[token] = self._vocab[token]
        return self._vocab[token]

    def tokenize(self, text: str) -> List[int]:
        ids, start = [], 0
        for match in self._special_pattern.finditer(text):
            ids.extend(self._processor.encode(text[start : match.start()], out_type=int))
            ids.append(self._special_ids[match.group()])
            start = match.end()
        ids.extend(self._processor.encode(text[start:], out_type=int))
        return ids

    def detokenize(self, ids: List[int]) -> str:
        """Decode runs of model pieces; special tokens are written out, separated by spaces as in Megatron-LM."""
        parts, run = [], []
        for token_id in (int(i) for i in ids):
            if token_id in self._special_by_id:
                parts.append(self._processor.decode(run) + " " + self._special_by_id[token_id] + " ")
                run = []
            else:
                run.append(token_id)
        parts.append(self._processor.decode(run))
        return "".join(parts)

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def mask(self) -> int:
        return self._mask_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return list(self._extra_ids)
