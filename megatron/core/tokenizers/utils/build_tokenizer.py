"""`build_tokenizer(args)`: the tokenizer named by `--tokenizer-type`, as Megatron-LM builds it (Megatron-Core 0.19's
`megatron.core.tokenizers.utils.build_tokenizer`)."""

import logging
from types import SimpleNamespace

from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer
from megatron.core.tokenizers.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megatron.core.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.core.tokenizers.tiktoken_tokenizer import (
    DEFAULT_NUM_SPECIAL_TOKENS,
    TIKTOKEN_PATTERNS,
    TikTokenizer,
)

logger = logging.getLogger(__name__)


def _build_tiktokenizer(args) -> TikTokenizer:
    pattern_name = getattr(args, "tiktoken_pattern", None) or "v2"
    if pattern_name not in TIKTOKEN_PATTERNS:
        raise ValueError(f"--tiktoken-pattern {pattern_name!r} is not one of {sorted(TIKTOKEN_PATTERNS)}")
    return TikTokenizer(
        getattr(args, "tokenizer_model", None),
        pattern=TIKTOKEN_PATTERNS[pattern_name],
        vocab_size=getattr(args, "vocab_size", None),
        num_special_tokens=getattr(args, "tiktoken_num_special_tokens", None) or DEFAULT_NUM_SPECIAL_TOKENS,
        special_tokens=getattr(args, "tiktoken_special_tokens", None),
    )


# --tokenizer-type value -> how to build it from the arguments.
TOKENIZER_BUILDERS = {
    "GPT2BPETokenizer": lambda args: GPT2BPETokenizer(
        getattr(args, "vocab_file", None), getattr(args, "merge_file", None)
    ),
    "HuggingFaceTokenizer": lambda args: HuggingFaceTokenizer(getattr(args, "tokenizer_model", None)),
    "SentencePieceTokenizer": lambda args: SentencePieceTokenizer(
        getattr(args, "tokenizer_model", None), vocab_extra_ids=getattr(args, "vocab_extra_ids", 0) or 0
    ),
    "GPTSentencePieceTokenizer": lambda args: GPTSentencePieceTokenizer(getattr(args, "tokenizer_model", None)),
    "Llama2Tokenizer": lambda args: Llama2Tokenizer(getattr(args, "tokenizer_model", None)),
    "TikTokenizer": _build_tiktokenizer,
    "NullTokenizer": lambda args: NullTokenizer(getattr(args, "vocab_size", None)),
}
TOKENIZER_TYPES = tuple(TOKENIZER_BUILDERS)


def build_tokenizer(args, **kwargs) -> MegatronTokenizer:
    """Build the tokenizer `args.tokenizer_type` names from an argparse-like namespace with Megatron's names;
    keyword arguments override the namesake attributes of `args` (e.g. `tokenizer_model=...`) for this build.

    Also sets `args.padded_vocab_size` (unless it is already set, e.g. from a checkpoint) to the vocabulary size
    padded for tensor parallelism, as Megatron-LM does.
    """
    options = SimpleNamespace(**{**vars(args), **kwargs}) if kwargs else args
    tokenizer_type = getattr(options, "tokenizer_type", None)
    if tokenizer_type not in TOKENIZER_BUILDERS:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {list(TOKENIZER_TYPES)}")
    if getattr(options, "rank", 0) == 0:
        logger.info("building %s tokenizer", tokenizer_type)
    tokenizer = TOKENIZER_BUILDERS[tokenizer_type](options)
    if getattr(args, "padded_vocab_size", None) is None:
        try:
            args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, options)
        except AttributeError:  # a read-only namespace: the caller pads itself
            pass
    return tokenizer


def vocab_size_with_padding(orig_vocab_size: int, args, logging_enabled: bool = True) -> int:
    """Round the vocabulary size up to a multiple of `make_vocab_size_divisible_by * tensor_model_parallel_size`,
    so the embedding and output layers split evenly across tensor-parallel ranks (as Megatron-LM)."""
    divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
    tensor_parallel = getattr(args, "tensor_model_parallel_size", 1)
    if not isinstance(divisible_by, int) or divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be a positive integer, got {divisible_by!r}")
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"--tensor-model-parallel-size must be a positive integer, got {tensor_parallel!r}")
    multiple = divisible_by * tensor_parallel
    padded = -(-int(orig_vocab_size) // multiple) * multiple
    if logging_enabled and getattr(args, "rank", 0) == 0:
        logger.info(
            "padded vocab (size: %d) with %d dummy tokens (new size: %d)",
            orig_vocab_size,
            padded - orig_vocab_size,
            padded,
        )
    return padded
