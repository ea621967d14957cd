"""Data-parallel training: DDP with contiguous bucketed gradient buffers, torch FSDP2, and finalize_model_grads."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fsdp import FullyShardedDataParallel  # importable; FSDP itself is not built yet
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "FullyShardedDataParallel",
    "TorchFullyShardedDataParallel",
    "TorchFullyShardedDataParallelConfig",
    "finalize_model_grads",
]
