"""Where each parameter lives in a DDP buffer, and where the buffer's buckets begin and end.

Parameters are laid out in reverse registration order (roughly the order backward produces their gradients) and
the buffer is cut into buckets of about ``bucket_size`` elements. With the distributed optimizer two padding rules
apply, the same as Megatron-Core's, so that shard boundaries (and so its bucket-space checkpoints) line up with
Megatron's: each parameter starts at a multiple of 64 elements, and each bucket ends at a multiple of
lcm(data-parallel size, 128) (and 2**16 with ``pad_buckets_for_high_nccl_busbw``), so every data-parallel rank owns
an equal contiguous shard of every bucket. A tied embedding (``shared_embedding``) gets a bucket of its own so that
its shards line up on the first and the last pipeline stage.

Megatron-Core keeps these names in ``megatron.core.optimizer.param_layout`` (which re-exports them); they live here,
below the optimizer, because the DDP buffers need them.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron.core.public_api import public_api

PARAM_START_ALIGNMENT = 64
BUCKET_ALIGNMENT = 128
HIGH_BUSBW_BUCKET_ALIGNMENT = 2**16


@public_api("megatron.core.optimizer.param_layout")
class BufferKey(NamedTuple):
    """What separates buffers: parameters of one dtype whose gradients are kept in one dtype, reduced over the dense
    or the expert data-parallel group, share a buffer."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool = False


@public_api("megatron.core.optimizer.param_layout")
@dataclass
class PerBufferParamLayout:
    """One buffer's layout: ``param_index_map`` gives each parameter's (start, end, bucket id); ``bucket_indices``
    each bucket's padded (start, end); ``per_bucket_numel_unpadded`` each bucket's size up to its last parameter's
    end; ``num_optimizer_shards`` the data-parallel size the padding was computed for (None: no padding)."""

    param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = field(default_factory=dict)
    bucket_indices: List[Tuple[int, int]] = field(default_factory=list)
    per_bucket_numel_unpadded: List[int] = field(default_factory=list)
    param_indices: List[int] = field(default_factory=list)
    num_optimizer_shards: Optional[int] = None


@public_api("megatron.core.optimizer.param_layout")
@dataclass
class FullParamLayout:
    """Every buffer's layout, by :class:`BufferKey`."""

    layouts: Dict[BufferKey, PerBufferParamLayout] = field(default_factory=dict)


@public_api("megatron.core.optimizer.param_layout")
def pad_to_divisor(value: int, divisor: int) -> int:
    """``value`` rounded up to a multiple of ``divisor``."""
    return -(-value // divisor) * divisor


@public_api("megatron.core.optimizer.param_layout")
def pad_param_start(param_start_index: int) -> int:
    """Where a parameter may start: the next multiple of 64 elements."""
    return pad_to_divisor(param_start_index, PARAM_START_ALIGNMENT)


@public_api("megatron.core.optimizer.param_layout")
def bucket_end_divisor(data_parallel_world_size: int, pad_for_high_nccl_busbw: bool) -> int:
    """What a bucket's padded size is a multiple of."""
    divisor = math.lcm(data_parallel_world_size, BUCKET_ALIGNMENT)
    return math.lcm(divisor, HIGH_BUSBW_BUCKET_ALIGNMENT) if pad_for_high_nccl_busbw else divisor


@public_api("megatron.core.optimizer.param_layout")
def pad_bucket_end(bucket_end_index: int, data_parallel_world_size: int, pad_for_high_nccl_busbw: bool) -> int:
    """Where a bucket ending at ``bucket_end_index`` ends once padded for equal data-parallel shards."""
    return pad_to_divisor(bucket_end_index, bucket_end_divisor(data_parallel_world_size, pad_for_high_nccl_busbw))


@public_api("megatron.core.distributed.param_and_grad_buffer")
def group_params_for_buffers(
    params: List[torch.nn.Parameter], grad_reduce_in_fp32: bool
) -> Dict[BufferKey, Tuple[List[torch.nn.Parameter], List[int]]]:
    """Split ``params`` by buffer: ``{BufferKey: (params, their indices in the input)}``, in input order.

    A parameter's gradient dtype is fp32 with ``grad_reduce_in_fp32``, else the parameter's own dtype; expert
    parameters (``allreduce=False``) go to buffers of their own, reduced over the expert data-parallel group.
    """
    groups: Dict[BufferKey, Tuple[List[torch.nn.Parameter], List[int]]] = {}
    for index, param in enumerate(params):
        grad_dtype = torch.float32 if grad_reduce_in_fp32 else param.dtype
        key = BufferKey(param.dtype, grad_dtype, not getattr(param, "allreduce", True))
        members, indices = groups.setdefault(key, ([], []))
        members.append(param)
        indices.append(index)
    return groups


def compute_per_buffer_param_layout(
    params: List[torch.nn.Parameter],
    bucket_size: Optional[int],
    data_parallel_world_size: int,
    ddp_config,
    param_indices: Optional[List[int]] = None,
) -> PerBufferParamLayout:
    """The layout of one buffer holding ``params``: padded as described in the module docstring with
    ``ddp_config.use_distributed_optimizer``, packed without padding otherwise. ``bucket_size`` None: one bucket."""
    padded = ddp_config.use_distributed_optimizer
    layout = PerBufferParamLayout(
        param_indices=list(param_indices or []), num_optimizer_shards=data_parallel_world_size if padded else None
    )
    bucket_start, index, bucket_params = 0, 0, 0

    def close_bucket():
        nonlocal bucket_start, index, bucket_params
        end = pad_bucket_end(index, data_parallel_world_size, ddp_config.pad_buckets_for_high_nccl_busbw)
        end = end if padded else index
        layout.bucket_indices.append((bucket_start, end))
        layout.per_bucket_numel_unpadded.append(index - bucket_start)
        bucket_start, index, bucket_params = end, end, 0

    for param in reversed(params):
        own_bucket = padded and bool(getattr(param, "shared_embedding", False))
        if own_bucket and bucket_params:
            close_bucket()
        start = pad_param_start(index) if padded else index
        index = start + param.numel()
        layout.param_index_map[param] = (start, index, len(layout.bucket_indices))
        bucket_params += 1
        if own_bucket or (bucket_size is not None and index - bucket_start >= bucket_size):
            close_bucket()
    if bucket_params:
        close_bucket()
    return layout


def compute_full_param_layout(
    params: List[torch.nn.Parameter],
    bucket_size: Optional[int],
    data_parallel_world_size: int,
    ddp_config,
    expert_data_parallel_world_size: Optional[int] = None,
) -> FullParamLayout:
    """Every buffer's layout (see :func:`compute_per_buffer_param_layout`); expert buffers are padded for the
    expert data-parallel size (default: ``data_parallel_world_size``)."""
    layouts = {}
    for key, (members, indices) in group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32).items():
        dp_size = data_parallel_world_size
        if key.is_expert_parallel and expert_data_parallel_world_size is not None:
            dp_size = expert_data_parallel_world_size
        layouts[key] = compute_per_buffer_param_layout(members, bucket_size, dp_size, ddp_config, indices)
    return FullParamLayout(layouts)
