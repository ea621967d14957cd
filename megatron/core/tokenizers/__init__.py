"""Tokenizers behind Megatron-LM's `--tokenizer-type` values, built with `build_tokenizer(args)`.

The libraries they use (`tokenizers`, `sentencepiece`, `tiktoken`) are optional: each is imported only when a
tokenizer that needs it is built. Tokenizer files are always read from local disk; nothing is downloaded.
"""

from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase
from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer
from megatron.core.tokenizers.utils.build_tokenizer import TOKENIZER_TYPES, build_tokenizer, vocab_size_with_padding
from megatron.core.tokenizers.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megatron.core.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.core.tokenizers.tiktoken_tokenizer import TikTokenizer

__all__ = [
    "MegatronTokenizer",
    "MegatronTokenizerBase",
    "build_tokenizer",
    "vocab_size_with_padding",
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
]
