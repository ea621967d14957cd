"""Transformer helpers: a module's default ``sharded_state_dict``, attention masks and activations.

The ShardedTensor builders (replica ids, tensor-parallel offsets) live in
:mod:`megatron.core.tensor_parallel.sharded_state`, below the tensor-parallel layers that use them; they are
re-exported here, Megatron's path.
"""

import functools
import logging
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.sharded_state import (  # noqa: F401  (re-exported: Megatron's path)
    ShardedOffsets,
    _extra_state_grid,
    make_sharded_object_for_checkpoint,
    make_sharded_tensor_for_checkpoint,
    make_sharded_tensors_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron.core.utils import get_current_device

logger = logging.getLogger(__name__)


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
