"""Helpers shared by the tensor-parallel tests: raw-collective gathers (independent of the code under test)."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def tp_group():
    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def tp_size() -> int:
    group = tp_group()
    return 1 if group is None else dist.get_world_size(group)


def tp_rank() -> int:
    group = tp_group()
    return 0 if group is None else dist.get_rank(group)


def gather_list(tensor: torch.Tensor):
    """Every TP rank's copy of ``tensor``, in TP-rank order (just ``[tensor]`` without groups)."""
    tensor = tensor.detach().contiguous()
    if tp_size() == 1:
        return [tensor.clone()]
    parts = [torch.empty_like(tensor) for _ in range(tp_size())]
    dist.all_gather(parts, tensor, group=tp_group())
    return parts


def gather(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate the TP ranks' ``tensor`` along ``dim``."""
    return torch.cat(gather_list(tensor), dim=dim)


def sum_over_tp(tensor: torch.Tensor) -> torch.Tensor:
    total = tensor.detach().clone()
    if tp_size() > 1:
        dist.all_reduce(total, group=tp_group())
    return total


def local_slice(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """This TP rank's equal slice of ``tensor`` along ``dim``."""
    return tensor.chunk(tp_size(), dim=dim)[tp_rank()].contiguous()


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5, what: str = "") -> None:
    """max |actual - expected| <= rel * max |expected| (relative error in the max norm)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().clamp_min(1e-12)
    error = (actual - expected).abs().max() / scale
    assert error <= rel, f"{what}: relative error {error.item():.3g} > {rel}"
