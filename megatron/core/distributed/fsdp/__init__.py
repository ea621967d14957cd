"""Megatron FSDP (``megatron.core.distributed.fsdp``): fully sharded data parallelism over DDP's buffers."""

from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel"]
