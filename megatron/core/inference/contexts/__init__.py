"""KV-cache contexts the model's attention reads through ``inference_context``."""

from megatron.core.inference.contexts.base_context import BaseInferenceContext
from megatron.core.inference.contexts.dynamic_context import (
    ActiveRequestCountOverflowError,
    BlockOverflowError,
    ContextOverflowError,
    DynamicInferenceContext,
    RequestOverflowError,
    TokenOverflowError,
)
from megatron.core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron.core.inference.contexts.static_context import StaticInferenceContext

__all__ = [
    "ActiveRequestCountOverflowError",
    "BaseInferenceContext",
    "BlockOverflowError",
    "ContextOverflowError",
    "DynamicInferenceContext",
    "KVBlockAllocator",
    "RequestOverflowError",
    "StaticInferenceContext",
    "TokenOverflowError",
]
