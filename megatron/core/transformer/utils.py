"""Building blocks of ``sharded_state_dict``: wrap a module's tensors as pieces of the global checkpoint.

Replica ids follow Megatron-Core's ``(pipeline, tensor, data)`` pattern. A tensor split over the tensor-parallel
group is ``(0, 0, dp_rank)``: every TP rank holds a different piece and data-parallel rank 0 saves it. A replicated
tensor is ``(0, tp_rank, dp_rank)``: only TP rank 0 of DP rank 0 is the main replica. The leading coordinate marks
copies held by another pipeline stage (the last stage's tied output weight is ``1``). So exactly one rank saves each
piece, and every rank can load it.
"""

import functools
import logging
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import get_current_device
from megatron.core.dist_checkpointing.mapping import ReplicaId, ShardedObject, ShardedTensor

logger = logging.getLogger(__name__)

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


def make_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    prepend_offsets: ShardedOffsets = (),
    replica_id: Optional[ReplicaId] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    dp_cp_group: Optional[dist.ProcessGroup] = None,
    **kwargs,
) -> ShardedTensor:
    """``tensor`` as a ShardedTensor replicated over the tensor- and data-parallel ranks (norms, biases of
    row-parallel layers, position embeddings), sharded only along the prepended axes."""
    prepend_offsets = tuple(prepend_offsets)
    if replica_id is None:
        replica_id = (0, _tp_rank_and_size(tp_group)[0], _dp_rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(
        key, tensor, *prepend_offsets, replica_id=replica_id, prepend_axis_num=len(prepend_offsets), **kwargs
    )


def make_tp_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    tp_axis: int = 0,
    replica_id: Optional[ReplicaId] = None,
    prepend_offsets: ShardedOffsets = (),
    tp_group: Optional[dist.ProcessGroup] = None,
    dp_cp_group: Optional[dist.ProcessGroup] = None,
    **kwargs,
) -> ShardedTensor:
    """``tensor`` as this tensor-parallel rank's piece along ``tp_axis`` (an axis of ``tensor``, not counting the
    prepended ones), replicated over the data-parallel ranks."""
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
    tp_group = kwargs.pop("tp_group", None)
    dp_cp_group = kwargs.pop("dp_cp_group", None)
    if replica_id is None:
        replica_id = (0, _tp_rank_and_size(tp_group)[0], _dp_rank(dp_cp_group))
    global_shape, global_offset = _extra_state_grid(sharded_offsets)
    return ShardedObject(key, obj, global_shape, global_offset, replica_id, **kwargs)


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


def sharded_state_dict_default(
    module: torch.nn.Module,
    prefix: str = "",
    sharded_offsets: Tuple[Tuple[int, int, int]] = (),
    metadata: Optional[dict] = None,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Dict[str, Any]:
    """``module.sharded_state_dict(...)`` when the module defines one; otherwise its whole state dict replicated
    (plain torch modules such as norms and position embeddings) over ``tp_group`` (the parallel_state group when
    None) and the data-parallel group (``metadata['dp_cp_group']`` when given)."""
    if hasattr(module, "sharded_state_dict"):
        return module.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
    plain_state = module.state_dict(prefix="", keep_vars=True)
    dp_cp_group = (metadata or {}).get("dp_cp_group")
    return make_sharded_tensors_for_checkpoint(
        plain_state, prefix, sharded_offsets=sharded_offsets, tp_group=tp_group, dp_cp_group=dp_cp_group
    )


def ensure_metadata_has_dp_cp_group(metadata: Optional[dict]) -> dict:
    """``metadata`` (a new dict when None) with ``dp_cp_group`` set to the data x context parallel group when it
    names none, so sharded-state builders below can compute replica ids from it."""
    metadata = {} if metadata is None else metadata
    if metadata.get("dp_cp_group") is None:
        metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata


@torch.no_grad()
def cat_with_oom_fallback(sub_state_dict):
    """``torch.cat`` of checkpoint pieces along axis 0; when the device runs out of memory, concatenate on CPU."""
    try:
        return torch.cat(sub_state_dict)
    except torch.OutOfMemoryError as error:
        logger.warning(
            "out of memory while merging %d checkpoint pieces, merging on CPU (%s)", len(sub_state_dict), error
        )
        return torch.cat([piece.cpu() for piece in sub_state_dict])


# ---- masks and activations -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def get_default_causal_mask(sq: int) -> torch.Tensor:
    """Causal mask ``[sq, sq]`` (True = masked: the keys after each query)."""
    return torch.ones(sq, sq, dtype=torch.bool, device=get_current_device()).triu(1)


@functools.lru_cache(maxsize=32)
def get_sliding_window_causal_mask(sq, skv, window_size):
    """Sliding-window mask ``[sq, skv]`` (True = masked), queries aligned with the last ``sq`` keys: query ``i``
    sees keys ``j`` with ``-window_size[0] <= j - (i + skv - sq) <= window_size[1]``; a negative bound is
    unlimited (``(-1, 0)`` is plain causal attention)."""
    left, right = window_size
    keep = torch.ones(sq, skv, dtype=torch.bool, device=get_current_device())
    if left >= 0:
        keep = keep.triu(skv - sq - left)
    if right >= 0:
        keep = keep.tril(skv - sq + right)
    return ~keep


def attention_mask_func(attention_scores, attention_mask):
    """Fill masked positions (True) of the attention scores with -10000, in place, as Megatron's softmax does."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def is_layer_window_attention(
    window_size: Optional[Tuple[int, int]], window_attn_skip_freq: int | list, layer_number: int
) -> bool:
    """Whether layer ``layer_number`` (1-based) uses sliding-window attention: never without a ``window_size``;
    with ``window_attn_skip_freq=N`` every N-th layer is full attention; a list gives 1 (window) / 0 per layer."""
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    if isinstance(window_attn_skip_freq, list):
        return bool(window_attn_skip_freq[layer_number - 1])
    raise ValueError(f"window_attn_skip_freq must be an int or a list of 0/1 per layer, got {window_attn_skip_freq!r}")


def gelu_impl(x):
    """GELU, tanh approximation (OpenAI GPT's)."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def openai_gelu(x):
    """GELU, tanh approximation (OpenAI GPT's)."""
    return gelu_impl(x)


def erf_gelu(x):
    """Exact GELU through erf, with Megatron's constant for sqrt(2) (so results match bit for bit)."""
    return x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + torch.ones_like(x).to(dtype=x.dtype))


def get_linear_layer(rows, columns, init_method, perform_initialization=True):
    """A plain ``torch.nn.Linear(rows, columns)``: weight from ``init_method`` (when initialising), zero bias."""
    layer = torch.nn.Linear(rows, columns)
    if perform_initialization:
        init_method(layer.weight)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


def set_model_to_sequence_parallel(model, set_to=False, exclude_modules=None):
    """Switch sequence parallelism of a built model on or off (e.g. off for inference with the training weights).

    Sets ``model.config.sequence_parallel`` and the ``sequence_parallel`` flag the tensor-parallel layers read at
    forward time, in every submodule except those in ``exclude_modules`` (and their children); embeddings re-derive
    whether they reduce-scatter. Parameter marks for gradient reduction are not changed: switch back before
    training again.
    """
    excluded = {id(module) for module in (exclude_modules or ())}
    model.config.sequence_parallel = set_to

    def visit(module):
        if id(module) in excluded:
            return
        if isinstance(getattr(module, "sequence_parallel", None), bool):
            module.sequence_parallel = set_to
        if hasattr(module, "update_reduce_scatter_embeddings"):
            module.update_reduce_scatter_embeddings()
        for child in module.children():
            visit(child)

    visit(model)
