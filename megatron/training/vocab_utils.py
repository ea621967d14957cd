"""Vocabulary padding for tensor parallelism, under Megatron-LM 0.19's ``megatron.training.vocab_utils`` name."""

from types import SimpleNamespace

from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding


def calculate_padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int, logging_enabled: bool = True
) -> int:
    """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * tensor_model_parallel_size``,
    so the embedding and output layers split evenly across tensor-parallel ranks."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    options = SimpleNamespace(
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, tensor_model_parallel_size=tensor_model_parallel_size
    )
    return vocab_size_with_padding(vocab_size, options, logging_enabled=logging_enabled)
