"""Small helpers for tensor parallelism: splitting tensors, vocabulary ranges, and resolving the TP group.

Every communicating function in this package takes an optional ``group``; :func:`resolve_tp_group` turns ``None``
into this rank's tensor-parallel group, or keeps ``None`` when no groups exist. A ``None`` group then means a
one-rank world, so the layers and mappings also work as plain single-process modules.
"""

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import divide, get_pg_rank, get_pg_size

# torch >= 2.10 renamed the single-tensor collectives; older releases (>= 2.4, our floor) have only the old names.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_tp_group(group: Optional[dist.ProcessGroup] = None, is_expert: bool = False):
    """``group`` if given, else this rank's tensor-parallel group (the expert one when ``is_expert``).

    Returns ``None`` when model-parallel groups have not been initialised: callers treat that as a one-rank group.
    """
    return parallel_state.get_tensor_model_parallel_group_if_none(group, is_expert=is_expert, check_initialized=False)


# In this package None is what resolve_tp_group answers when no model-parallel groups exist: a one-rank group. It is
# not torch.distributed's default (world) group, which is what get_pg_size/get_pg_rank read None as.
def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Number of ranks in ``group`` (1 for ``None``, the uninitialised single-process case)."""
    return 1 if group is None else get_pg_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else get_pg_rank(group)


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> List[torch.Tensor]:
    """Split ``tensor`` into ``num_partitions`` equal views along its last dimension.

    With ``contiguous_split_chunks`` each piece is made contiguous (a copy), as collectives need.
    """
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return [chunk.contiguous() for chunk in chunks]
    return list(chunks)


def split_tensor_into_1d_equal_chunks(tensor, new_buffer=False, tp_group=None):
    """This TP rank's slice of ``tensor`` flattened: element range ``[rank * n/tp, (rank + 1) * n/tp)``.

    ``new_buffer`` returns a copy, so the full tensor's storage can be freed; otherwise a view. ``tp_group``
    defaults to this rank's tensor-parallel group.
    """
    group = resolve_tp_group(tp_group)
    world_size = group_size(group)
    flat = tensor.reshape(-1)
    if flat.numel() % world_size != 0:
        raise ValueError(
            f"cannot split a tensor of {flat.numel()} elements (shape {tuple(tensor.shape)}) into "
            f"{world_size} equal tensor-parallel chunks; its size must be divisible by the TP size"
        )
    chunk_size = flat.numel() // world_size
    chunk = flat[group_rank(group) * chunk_size : (group_rank(group) + 1) * chunk_size]
    return chunk.clone() if new_buffer else chunk


def gather_split_1d_tensor(tensor, tp_group=None):
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: all-gather the TP ranks' flat chunks into one tensor."""
    group = resolve_tp_group(tp_group)
    world_size = group_size(group)
    flat = tensor.reshape(-1)
    if world_size == 1:
        return flat
    gathered = torch.empty(world_size * flat.numel(), dtype=tensor.dtype, device=tensor.device)
    all_gather_into_tensor(gathered, flat.contiguous(), group=group)
    return gathered


class VocabUtility:
    """Which contiguous slice ``[first, last)`` of the vocabulary a tensor-parallel rank owns."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank, world_size: int
    ) -> Sequence[int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Sequence[int]:
        if global_vocab_size % world_size != 0:
            raise ValueError(
                f"vocabulary size {global_vocab_size} is not divisible by the tensor-parallel size {world_size}; "
                "pad it (Megatron pads to a multiple of make_vocab_size_divisible_by * tensor_model_parallel_size)"
            )
        return VocabUtility.vocab_range_from_per_partition_vocab_size(global_vocab_size // world_size, rank, world_size)
