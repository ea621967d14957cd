"""DistributedDataParallelConfig: how gradients are bucketed and reduced across data-parallel ranks."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class DistributedDataParallelConfig:
    """Settings of :class:`megatron.core.distributed.DistributedDataParallel` (Megatron-Core's field names)."""

    grad_reduce_in_fp32: bool = False
    """Keep the gradient buffer (and reduce it) in fp32 even when the parameters are bf16/fp16."""
    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction asynchronously as soon as its last gradient is ready during backward."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather updated parameters bucket by bucket during the next forward."""
    align_param_gather: bool = False
    """With pipeline parallelism: launch all chunks' parameter all-gathers together (accepted; gathers here are
    dispatched per bucket at first use)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks: reduce-scatter gradients, all-gather parameters."""
    num_distributed_optimizer_instances: int = 1
    """Number of distributed-optimizer replicas (only 1 is supported)."""
    check_for_nan_in_grad: bool = False
    """Before reducing, check each bucket's local gradients for NaN/Inf and raise naming the rank and iteration."""
    check_for_large_grads: bool = False
    """Megatron's fault-injection check for unexpectedly large gradients (not supported: must be False)."""
    bucket_size: Optional[int] = None
    """Elements per bucket (None: max(40M, 1M x DP size) when overlapping the reduction, one bucket otherwise)."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad buckets to a multiple of 2^16 elements as well (faster NCCL reduce-scatter for some DP sizes)."""
    average_in_collective: bool = False
    """Average inside the collective (ReduceOp.AVG) instead of scaling gradients by 1/DP before summing."""
    fp8_param_gather: bool = False
    """All-gather FP8 parameters (needs Transformer Engine FP8; not supported: must be False)."""
    use_megatron_fsdp: bool = False
    """Megatron FSDP (not supported: must be False)."""
    use_custom_fsdp: bool = False
    """Deprecated name of use_megatron_fsdp (not supported: must be False)."""
    data_parallel_sharding_strategy: str = "no_shard"
    """FSDP sharding strategy; only 'no_shard' (plain DDP / distributed optimizer) is supported."""
    gradient_reduce_div_fusion: bool = True
    """Fuse the 1/DP scaling into the collective where the backend can (a hint; results are the same)."""

    def __post_init__(self):
        _reject_unsupported(self)
        if self.bucket_size is not None and (not isinstance(self.bucket_size, int) or self.bucket_size < 1):
            raise ValueError(
                f"bucket_size must be a positive number of elements or None, got {self.bucket_size!r}"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "overlap_param_gather=True needs use_distributed_optimizer=True (only the distributed optimizer "
                "all-gathers parameters); set both or neither"
            )


def _reject_unsupported(config: DistributedDataParallelConfig) -> None:
    for name in ("check_for_large_grads", "fp8_param_gather", "use_megatron_fsdp", "use_custom_fsdp"):
        if getattr(config, name):
            raise ValueError(f"DistributedDataParallelConfig.{name}=True is not supported; leave it False")
    if config.num_distributed_optimizer_instances != 1:
        raise ValueError(
            f"DistributedDataParallelConfig.num_distributed_optimizer_instances="
            f"{config.num_distributed_optimizer_instances} is not supported; use 1"
        )
    if config.data_parallel_sharding_strategy != "no_shard":
        raise ValueError(
            f"DistributedDataParallelConfig.data_parallel_sharding_strategy="
            f"{config.data_parallel_sharding_strategy!r} is not supported; use 'no_shard' (with "
            "use_distributed_optimizer=True for ZeRO-1 sharding)"
        )
