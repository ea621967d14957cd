"""``InferenceConfig``: how big the dynamic engine's KV cache and batches are (``MegatronLLM``'s settings)."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class InferenceConfig:
    """Sizes of the dynamic context that ``MegatronLLM`` builds.

    ``max_sequence_length`` defaults to the model's; the KV cache holds ``num_blocks`` blocks of
    ``block_size_tokens`` tokens, or as many as fit ``buffer_size_gb`` per rank, or (neither given) enough for
    ``max_requests`` sequences of ``max_sequence_length``.
    """

    max_sequence_length: Optional[int] = None
    buffer_size_gb: Optional[float] = None
    num_blocks: Optional[int] = None
    block_size_tokens: int = 256
    max_requests: int = 64
    max_tokens: Optional[int] = None
    random_seed: Optional[int] = None
