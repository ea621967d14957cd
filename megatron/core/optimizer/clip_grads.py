"""Global gradient norm, clipping and zero counting over every rank that holds a distinct part of the model.

Each rank passes only the gradients it is responsible for counting (see
``MegatronOptimizer.get_main_grads_for_grad_norm``): parameters split across tensor-parallel ranks count on every
rank, replicated ones (norms, biases of row-parallel layers, sequence-parallel parameters after their all-reduce)
on TP rank 0 only, and the last pipeline stage's copy of a tied embedding (``param.shared``) not at all. The partial
sums are then all-reduced over ``grad_stats_parallel_group`` (the model-parallel group, or every rank for the
distributed optimizer, whose data-parallel ranks each hold a different shard).
"""

import math
from typing import List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.utils import get_current_device, to_local_if_dtensor


def _as_list(tensors) -> List[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _local(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """This rank's pieces of DTensor gradients (FSDP2's shards: each is summed over the ranks like a TP piece)."""
    with torch.no_grad():
        return [to_local_if_dtensor(t) for t in tensors]


def _all_reduce(value: torch.Tensor, op, group) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=op, group=group)


def get_grad_norm_fp32(
    grads_for_norm: Union[List[torch.Tensor], torch.Tensor],
    norm_type: Union[int, float] = 2,
    grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
) -> float:
    """The ``norm_type`` norm (2, any p > 0, or inf) of all these gradients across ``grad_stats_parallel_group``."""
    grads = _local(_as_list(grads_for_norm))
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (2, any p > 0 or inf), got {norm_type}")
    device = grads[0].device if grads else get_current_device()
    if norm_type == math.inf:
        total = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            total = torch.stack([g.detach().abs().max().float() for g in grads]).max()
        _all_reduce(total, dist.ReduceOp.MAX, grad_stats_parallel_group)
        return total.item()
    total = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        norms = torch._foreach_norm([g.detach() for g in grads], norm_type)
        total = torch.stack([n.float() for n in norms]).pow(norm_type).sum()
    _all_reduce(total, dist.ReduceOp.SUM, grad_stats_parallel_group)
    return total.pow(1.0 / norm_type).item()


def _grads_of(parameters, use_decoupled_grad: bool) -> List[torch.Tensor]:
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    return [getattr(p, attr) for p in _as_list(parameters) if getattr(p, attr, None) is not None]


def clip_grad_by_total_norm_fp32(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    max_norm: Union[int, float],
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale the gradients of ``parameters`` in place so that a global norm of ``total_norm`` becomes ``max_norm``."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        grads = _local(_grads_of(parameters, use_decoupled_grad))
        if grads:
            torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    grad_stats_parallel_group: torch.distributed.ProcessGroup,
    use_decoupled_grad: bool = False,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
    expert_tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> float:
    """Number of zero gradient entries across ``grad_stats_parallel_group`` (None: every rank), each replicated
    parameter once: dense parameters are replicated across ``tp_group``, expert parameters (``allreduce=False``)
    across ``expert_tp_group``."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    zeros = torch.zeros((), dtype=torch.float32, device=get_current_device())
    for param in _as_list(parameters):
        grad = getattr(param, attr, None)
        is_expert = not getattr(param, "allreduce", True)
        group = expert_tp_group if is_expert and expert_tp_group is not None else tp_group
        if grad is None or not counts_for_grad_stats(param, group):
            continue
        grad = to_local_if_dtensor(grad)
        zeros = zeros + (grad.numel() - torch.count_nonzero(grad))
    _all_reduce(zeros, dist.ReduceOp.SUM, grad_stats_parallel_group)
    return zeros.item()


def counts_for_grad_stats(param: torch.Tensor, tp_group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether this rank counts ``param`` in global gradient statistics (so every value is counted exactly once)."""
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, tp_group)
