"""Megatron FSDP's import path (``megatron.core.distributed.fsdp``); FSDP itself is not built yet."""

from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel"]
