"""DistributedDataParallelConfig: how gradients are bucketed and reduced across data-parallel ranks."""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


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
    num_buckets: Optional[int] = None
    """A fixed number of buckets instead of a bucket size (not supported yet: must be None)."""
    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad buckets to a multiple of 2^16 elements as well (faster NCCL reduce-scatter for some DP sizes)."""
    reduce_scatter_with_fp32_accumulation: bool = False
    """Reduce-scatter low-precision gradients accumulating in fp32 (not supported yet: must be False)."""
    param_name_patterns_for_fp32_local_accumulation: Tuple[str, ...] = ()
    """Parameters (by name pattern) whose gradients accumulate locally in fp32 (not supported yet: must be ())."""
    average_in_collective: bool = False
    """Average inside the collective (ReduceOp.AVG) instead of scaling gradients by 1/DP before summing."""
    fp8_param_gather: bool = False
    """All-gather FP8 parameters (needs Transformer Engine FP8; not supported yet: must be False)."""
    fp4_param_gather: bool = False
    """All-gather FP4 parameters (not supported yet: must be False)."""
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """Reuse the gradient buffer for MXFP8 parameter all-gathers (not supported yet: must be False)."""
    use_megatron_fsdp: bool = False
    """Megatron FSDP: wrap the model in ``megatron.core.distributed.fsdp.FullyShardedDataParallel``."""
    use_custom_fsdp: bool = False
    """Deprecated name of use_megatron_fsdp (read as use_megatron_fsdp)."""
    data_parallel_sharding_strategy: str = "no_shard"
    """Megatron FSDP's sharding over data-parallel ranks: 'no_shard' (DDP), 'optim' (optimizer state, ZeRO-1),
    'optim_grads' (+ gradients, ZeRO-2), 'optim_grads_params' (+ parameters, ZeRO-3). The sharded strategies
    need use_distributed_optimizer=True."""
    gradient_reduce_div_fusion: bool = True
    """Fuse the 1/DP scaling into the collective where the backend can (a hint; results are the same)."""
    suggested_communication_unit_size: Optional[int] = None
    """FSDP communication unit size (not supported yet: must be None)."""
    keep_fp8_transpose_cache: bool = False
    """Keep FP8 weight transposes between steps under FSDP (not supported yet: must be False)."""
    nccl_ub: bool = False
    """NCCL user-buffer registration of the communication buffers (not supported yet: must be False)."""
    fsdp_double_buffer: bool = False
    """Megatron FSDP (optim_grads_params only): Megatron's two alternating gather buffers. Accepted and checked;
    gathers here allocate each unit's parameters when it runs and free them after, so no buffer pool is kept."""
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    """FSDP double-buffer fallback to a persistent buffer (not supported yet: must be False)."""
    fsdp_all_gather_in_start_param_sync: bool = True
    """FSDP: all-gather in start_param_sync (FSDP is not supported yet: must stay True)."""
    outer_dp_sharding_strategy: str = "no_shard"
    """Hybrid FSDP's outer data-parallel sharding (not supported yet: must be 'no_shard')."""
    disable_symmetric_registration: bool = False
    """Turn off NCCL symmetric-memory registration. Accepted either way: no buffer is ever registered here."""
    fsdp_manual_registration: bool = False
    """FSDP manual NCCL buffer registration (not supported yet: must be False)."""
    delay_wgrad_compute: bool = False
    """Delay weight-gradient computation to overlap it with communication (not supported yet: must be False)."""
    megatron_fsdp_main_params_dtype: Optional[torch.dtype] = torch.float32
    """Megatron FSDP: dtype of the optimizer's main parameters (only torch.float32 is supported)."""
    megatron_fsdp_main_grads_dtype: Optional[torch.dtype] = None
    """Megatron FSDP: dtype of the gradient buffers and the sharded gradients (None: fp32 with
    grad_reduce_in_fp32, else the parameters' dtype)."""
    megatron_fsdp_grad_comm_dtype: Optional[torch.dtype] = None
    """Megatron FSDP: dtype the gradient reduce-scatter runs in (None: the main-gradient dtype)."""
    megatron_fsdp_use_decoupled_grad: bool = False
    """Megatron FSDP decoupled gradients (not supported yet: must be False)."""
    megatron_fsdp_cuda_graph_mode: bool = False
    """Megatron FSDP CUDA-graph mode (not supported yet: must be False)."""
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    """Megatron FSDP fine-grained parameter gather (not supported yet: must be False)."""
    megatron_fsdp_max_pool_double_buffer: bool = False
    """Megatron FSDP max-pool double buffer (not supported yet: must be False)."""

    def __post_init__(self):
        _reject_unsupported(self)
        _check_fsdp(self)
        if self.bucket_size is not None and (not isinstance(self.bucket_size, int) or self.bucket_size < 1):
            raise ValueError(f"bucket_size must be a positive number of elements or None, got {self.bucket_size!r}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "overlap_param_gather=True needs use_distributed_optimizer=True (only the distributed optimizer "
                "all-gathers parameters); set both or neither"
            )


# field -> (feature, Megatron's default): a field that differs from its default is refused.
_UNSUPPORTED = {
    "num_buckets": ("a fixed number of gradient buckets", None),
    "reduce_scatter_with_fp32_accumulation": ("reduce-scatter with fp32 accumulation", False),
    "param_name_patterns_for_fp32_local_accumulation": ("fp32 local gradient accumulation", ()),
    "check_for_large_grads": ("large-gradient fault detection", False),
    "fp8_param_gather": ("FP8 parameter all-gather", False),
    "fp4_param_gather": ("FP4 parameter all-gather", False),
    "reuse_grad_buf_for_mxfp8_param_ag": ("mxfp8 parameter all-gather in the gradient buffer", False),
    "num_distributed_optimizer_instances": ("several distributed-optimizer instances", 1),
    "suggested_communication_unit_size": ("FSDP communication units", None),
    "keep_fp8_transpose_cache": ("FP8 transpose cache under FSDP", False),
    "nccl_ub": ("NCCL user buffers", False),
    "fsdp_db_use_persist_buf_on_alloc_fail": ("FSDP double buffering", False),
    "fsdp_all_gather_in_start_param_sync": ("Megatron FSDP", True),
    "outer_dp_sharding_strategy": ("hybrid FSDP", "no_shard"),
    "fsdp_manual_registration": ("FSDP manual buffer registration", False),
    "delay_wgrad_compute": ("delayed weight-gradient compute", False),
    "megatron_fsdp_use_decoupled_grad": ("Megatron FSDP", False),
    "megatron_fsdp_cuda_graph_mode": ("Megatron FSDP", False),
    "megatron_fsdp_enable_fine_grained_param_gather": ("Megatron FSDP", False),
    "megatron_fsdp_max_pool_double_buffer": ("Megatron FSDP", False),
}


def _reject_unsupported(config: DistributedDataParallelConfig) -> None:
    for name, (feature, default) in _UNSUPPORTED.items():
        value = getattr(config, name)
        if isinstance(value, list):  # a list of name patterns means the same as the tuple
            value = tuple(value)
        if value != default:
            raise ValueError(
                f"DistributedDataParallelConfig: not supported yet: {feature} ({name}={value!r}); "
                f"leave it at {default!r}"
            )


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_FSDP_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def _check_fsdp(config: DistributedDataParallelConfig) -> None:
    """Megatron FSDP's fields: valid alone and together (each error names both fields and what to use)."""
    if config.use_custom_fsdp:
        config.use_megatron_fsdp = True  # Megatron's deprecated spelling of the same switch
    strategy = config.data_parallel_sharding_strategy
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"data_parallel_sharding_strategy={strategy!r} is not one of {SHARDING_STRATEGIES}")
    if not config.use_megatron_fsdp:
        fsdp_only = {
            "data_parallel_sharding_strategy": (strategy, "no_shard"),
            "fsdp_double_buffer": (config.fsdp_double_buffer, False),
            "megatron_fsdp_main_grads_dtype": (config.megatron_fsdp_main_grads_dtype, None),
            "megatron_fsdp_grad_comm_dtype": (config.megatron_fsdp_grad_comm_dtype, None),
        }
        for name, (value, default) in fsdp_only.items():
            if value != default:
                raise ValueError(
                    f"{name}={value!r} is read only by Megatron FSDP: set use_megatron_fsdp=True, or leave it at "
                    f"{default!r} (for ZeRO-1 without FSDP use use_distributed_optimizer=True)"
                )
        return
    sharded = strategy != "no_shard"
    if sharded != config.use_distributed_optimizer:
        fix = "set use_distributed_optimizer=True" if sharded else "use data_parallel_sharding_strategy='optim'"
        raise ValueError(
            f"data_parallel_sharding_strategy={strategy!r} with use_distributed_optimizer="
            f"{config.use_distributed_optimizer}: the sharded strategies step the optimizer through the distributed "
            f"optimizer and 'no_shard' does not; {fix}"
        )
    if config.fsdp_double_buffer and strategy != "optim_grads_params":
        raise ValueError(
            f"fsdp_double_buffer=True with data_parallel_sharding_strategy={strategy!r}: double buffering holds "
            "gathered parameters, which only 'optim_grads_params' shards; use that strategy or drop fsdp_double_buffer"
        )
    if config.megatron_fsdp_main_params_dtype != torch.float32:
        raise ValueError(
            f"megatron_fsdp_main_params_dtype={config.megatron_fsdp_main_params_dtype!r}: not supported yet, the "
            "optimizer's main parameters are fp32; leave it at torch.float32"
        )
    for name in ("megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype"):
        if getattr(config, name) not in _FSDP_DTYPES:
            raise ValueError(f"{name}={getattr(config, name)!r} must be one of {_FSDP_DTYPES}")
