"""Data-parallel training: DDP with contiguous bucketed gradient buffers, and finalize_model_grads."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fsdp import FullyShardedDataParallel  # importable; FSDP itself is not built yet

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "FullyShardedDataParallel",
    "finalize_model_grads",
]
