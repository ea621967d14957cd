"""Building blocks of ``sharded_state_dict``: wrap a module's tensors as pieces of the global checkpoint.

Replica ids follow Megatron-Core's ``(pipeline, tensor, data)`` pattern. A tensor split over the tensor-parallel
group is ``(0, 0, dp_rank)``: every TP rank holds a different piece and data-parallel rank 0 saves it. A replicated
tensor is ``(0, tp_rank, dp_rank)``: only TP rank 0 of DP rank 0 is the main replica. The leading coordinate marks
copies held by another pipeline stage (the last stage's tied output weight is ``1``). So exactly one rank saves each
piece, and every rank can load it.

The groups default to parallel_state's; ``tp_group`` / ``dp_cp_group`` keyword arguments name others. Megatron's
public paths for these helpers are ``megatron.core.utils`` and ``megatron.core.transformer.utils``.
"""

from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.public_api import public_api
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ReplicaId, ShardedObject, ShardedTensor

# (axis, index of this rank's piece, number of pieces) for each axis prepended to a tensor, e.g. the layer axis.
ShardedOffsets = Iterable[Tuple[int, int, int]]


def _tp_rank_and_size(tp_group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    if tp_group is not None:
        return dist.get_rank(tp_group), dist.get_world_size(tp_group)
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _dp_rank(dp_cp_group: Optional[dist.ProcessGroup]) -> int:
    if dp_cp_group is not None:
        return dist.get_rank(dp_cp_group)
    return parallel_state.get_data_parallel_rank(with_context_parallel=True)


@public_api("megatron.core.utils")
def make_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    prepend_offsets: ShardedOffsets = (),
    replica_id: Optional[ReplicaId] = None,
    **kwargs,
) -> ShardedTensor:
    """``tensor`` as a ShardedTensor replicated over the tensor- and data-parallel ranks (norms, biases of
    row-parallel layers, position embeddings), sharded only along the prepended axes. Other keyword arguments
    (besides ``tp_group`` / ``dp_cp_group``) go to ShardedTensor."""
    tp_group, dp_cp_group = kwargs.pop("tp_group", None), kwargs.pop("dp_cp_group", None)
    prepend_offsets = tuple(prepend_offsets)
    if replica_id is None:
        replica_id = (0, _tp_rank_and_size(tp_group)[0], _dp_rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(
        key, tensor, *prepend_offsets, replica_id=replica_id, prepend_axis_num=len(prepend_offsets), **kwargs
    )


@public_api("megatron.core.utils")
def make_tp_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    tp_axis: int = 0,
    replica_id: Optional[ReplicaId] = None,
    prepend_offsets: ShardedOffsets = (),
    **kwargs,
) -> ShardedTensor:
    """``tensor`` as this tensor-parallel rank's piece along ``tp_axis`` (an axis of ``tensor``, not counting the
    prepended ones), replicated over the data-parallel ranks."""
    tp_group, dp_cp_group = kwargs.pop("tp_group", None), kwargs.pop("dp_cp_group", None)
    prepend_offsets = tuple(prepend_offsets)
    tp_rank, tp_size = _tp_rank_and_size(tp_group)
    if replica_id is None:
        replica_id = (0, 0, _dp_rank(dp_cp_group))
    tp_offset = (tp_axis + len(prepend_offsets), tp_rank, tp_size)
    return ShardedTensor.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        tp_offset,
        replica_id=replica_id,
        prepend_axis_num=len(prepend_offsets),
        **kwargs,
    )


def _extra_state_grid(sharded_offsets: ShardedOffsets) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(global shape, offset) of an object placed on the grid the prepended axes span, e.g. one per layer."""
    sharded_offsets = sorted(sharded_offsets, key=lambda offset: offset[0])
    if not sharded_offsets:
        return (1,), (0,)
    axes = [axis for axis, _, _ in sharded_offsets]
    if axes != list(range(len(axes))):
        raise ValueError(f"sharded_offsets must cover the leading axes 0, 1, ... in turn, got axes {axes}")
    return (
        tuple(fragments for _, _, fragments in sharded_offsets),
        tuple(index for _, index, _ in sharded_offsets),
    )


@public_api("megatron.core.transformer.utils")
def make_sharded_object_for_checkpoint(
    obj: Any,
    key: str,
    sharded_offsets: Iterable[Tuple[int, int, int]] = (),
    replica_id: Union[None, int, Tuple[int, ...]] = None,
    **kwargs,
):
    """``obj`` (a module's ``_extra_state``) as a ShardedObject: one per position on the prepended axes (one per
    layer in a block), replicated over the tensor- and data-parallel ranks (``tp_group`` / ``dp_cp_group`` keyword
    arguments name the groups; the parallel_state ones otherwise). Other keyword arguments go to ShardedObject."""
    tp_group, dp_cp_group = kwargs.pop("tp_group", None), kwargs.pop("dp_cp_group", None)
    if replica_id is None:
        replica_id = (0, _tp_rank_and_size(tp_group)[0], _dp_rank(dp_cp_group))
    global_shape, global_offset = _extra_state_grid(sharded_offsets)
    return ShardedObject(key, obj, global_shape, global_offset, replica_id, **kwargs)


@public_api("megatron.core.transformer.utils")
def make_sharded_tensors_for_checkpoint(
    state_dict: Dict[str, Any],
    prefix: str,
    tensor_parallel_layers_axis_map: Optional[Dict[str, int]] = None,
    sharded_offsets: Iterable[Tuple[int, int, int]] = (),
    extra_state_suffix: str = "_extra_state",
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
    dp_cp_group: Optional[torch.distributed.ProcessGroup] = None,
):
    """Wrap every entry of a module's own ``state_dict`` (``keep_vars=True``) under the checkpoint key
    ``prefix + name``.

    Names in ``tensor_parallel_layers_axis_map`` are split over the tensor-parallel group along the given axis; names
    ending in ``extra_state_suffix`` become ShardedObjects; everything else is replicated.
    """
    axis_map = tensor_parallel_layers_axis_map or {}
    groups = dict(tp_group=tp_group, dp_cp_group=dp_cp_group)
    sharded_state_dict = {}
    for name, value in state_dict.items():
        key = f"{prefix}{name}"
        if name.endswith(extra_state_suffix):
            sharded_state_dict[key] = make_sharded_object_for_checkpoint(value, key, sharded_offsets, **groups)
        elif name in axis_map:
            sharded_state_dict[key] = make_tp_sharded_tensor_for_checkpoint(
                value, key, axis_map[name], prepend_offsets=sharded_offsets, **groups
            )
        else:
            sharded_state_dict[key] = make_sharded_tensor_for_checkpoint(
                value, key, prepend_offsets=sharded_offsets, **groups
            )
    return sharded_state_dict
