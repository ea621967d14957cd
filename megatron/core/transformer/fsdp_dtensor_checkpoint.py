"""Names and pieces of Megatron-LM's ``fsdp_dtensor`` checkpoint layout (``--ckpt-format fsdp_dtensor``).

An ``fsdp_dtensor`` checkpoint is one PyTorch DCP state dict whose tensors are global: every parameter is one entry
with its whole shape (over tensor parallelism as well), stored in whatever pieces the saving ranks held. Megatron-LM
writes DTensors; here each rank writes its flat piece of a parameter (the elements of its data-parallel shard) as the
boxes that cover it (:class:`CheckpointableShardedTensor`), which DCP stores and reshards the same way, so any
data-parallel size reads it back.

The names are Megatron's: a model entry is ``module.<state-dict name>`` (Megatron FSDP's wrapper adds the
``module.``), an optimizer entry is named after the parameter as the optimizer's model chunks see it, and both use
the global expert index (:func:`handle_experts_in_state_dict`). Transformer layers are numbered globally
(:func:`get_global_unique_param_name`), which with one pipeline stage is the module's own number. The fused
``linear_fc1`` of a gated MLP (SwiGLU) is stored as its two halves, ``..._w`` and ``..._v``, each split over tensor
parallelism on its own, so a checkpoint reloads at another tensor-parallel size.
"""

import re
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.checkpointable import CheckpointableShardedTensor
from megatron.core.transformer.transformer_layer import TransformerLayer

_SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight(\d+)")
_SWIGLU_KEYS = [
    re.compile(pattern)
    for pattern in (
        r"\.mlp\.linear_fc1\.(weight|bias)$",
        r"\.mlp\.experts\.linear_fc1\.(weight|bias)\d+$",
        r"\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.(weight|bias)$",
        r"\.mlp\.shared_experts\.linear_fc1\.(weight|bias)$",
    )
]


def get_ep_layer_offset(num_experts: Optional[int] = None) -> int:
    """The global index of this expert-parallel rank's first local expert (0 without experts)."""
    if not num_experts:
        return 0
    return parallel_state.get_expert_model_parallel_rank() * (
        num_experts // parallel_state.get_expert_model_parallel_world_size()
    )


def get_expert_index_from_key(key: str) -> Optional[int]:
    """The (local) expert index in a SequentialMLP (``local_experts.<i>.``) or grouped (``weight<i>``) key."""
    match = _SEQUENTIAL_EXPERT.search(key) or _GROUPED_EXPERT.search(key)
    return int(match.group(1)) if match else None


def _with_expert_index(key: str, local: int, offset: int) -> str:
    if _SEQUENTIAL_EXPERT.search(key):
        return key.replace(f"local_experts.{local}.", f"local_experts.{local + offset}.", 1)
    return re.sub(rf"(linear_fc[12]\.weight){local}\b", rf"\g<1>{local + offset}", key, count=1)


def handle_experts_in_state_dict(state_dict: dict, num_experts: Optional[int] = None) -> dict:
    """``state_dict`` with every expert key renamed from its local expert index to the global one."""
    offset = get_ep_layer_offset(num_experts)
    renamed = {}
    for key, value in state_dict.items():
        index = get_expert_index_from_key(key)
        renamed[key if index is None or offset == 0 else _with_expert_index(key, index, offset)] = value
    return renamed


def _global_layer_names(named: Dict[str, torch.nn.Parameter], module: torch.nn.Module) -> Dict:
    """``{param: name}`` with each transformer layer's local index replaced by its global one."""
    names = {param: name for name, param in named.items()}
    for layer in module.modules():
        if isinstance(layer, TransformerLayer):
            for param in layer.parameters():
                if param in names:
                    names[param] = re.sub(r"layers\.(\d+)", f"layers.{layer.layer_number - 1}", names[param], count=1)
    return names


def global_param_names(model_chunk: torch.nn.Module, root: Optional[torch.nn.Module] = None) -> Dict:
    """``{param: its global unique name}`` for every parameter of ``model_chunk``, named from ``root`` (default:
    the chunk itself; pass the unwrapped model for state-dict names)."""
    root = model_chunk if root is None else root
    names = _global_layer_names(dict(root.named_parameters()), root)
    num_experts = getattr(getattr(model_chunk, "config", None), "num_moe_experts", None)
    return {param: next(iter(handle_experts_in_state_dict({name: None}, num_experts))) for param, name in names.items()}


def get_global_unique_param_name(model_chunks: List[torch.nn.Module], param: torch.nn.Parameter) -> str:
    """The name of ``param`` in its model chunk with global layer and expert numbers (Megatron's signature)."""
    for chunk in model_chunks:
        names = global_param_names(chunk)
        if param in names:
            return names[param]
    raise ValueError("Parameter not found in model chunks")


def _tensor_parallel_offset(param: torch.nn.Parameter) -> List[tuple]:
    """``[(axis, rank, size)]`` of a tensor-parallel parameter (expert tensor parallelism for expert parameters)."""
    if not getattr(param, "tensor_model_parallel", False):
        return []
    if getattr(param, "allreduce", True):
        rank = parallel_state.get_tensor_model_parallel_rank()
        size = parallel_state.get_tensor_model_parallel_world_size()
    else:
        rank = parallel_state.get_expert_tensor_parallel_rank()
        size = parallel_state.get_expert_tensor_parallel_world_size()
    return [(param.partition_dim, rank, size)] if size > 1 else []


def is_swiglu_key(key: str) -> bool:
    """Whether ``key`` is the fused ``linear_fc1`` weight or bias of a gated MLP (stored as ``_w`` and ``_v``)."""
    return any(pattern.search(key) for pattern in _SWIGLU_KEYS)


def flat_piece_entries(
    key: str, param: torch.nn.Parameter, flat: torch.Tensor, start: int, gated: bool
) -> Dict[str, CheckpointableShardedTensor]:
    """The checkpoint entries of ``flat``, elements ``[start, start + flat.numel())`` of ``param``'s flattened
    (tensor-parallel-local) tensor: ``{key: entry}``, or for a gated MLP's ``linear_fc1`` its ``_w`` / ``_v``
    halves. Saving writes ``flat``; loading fills it in place. Halves this rank holds nothing of are left out."""
    shape, end = tuple(param.shape), start + flat.numel()
    if gated and is_swiglu_key(key):
        half = param.numel() // 2
        parts = [(f"{key}_w", 0), (f"{key}_v", half)]
        part_shape, part_numel = (shape[0] // 2, *shape[1:]), half
    else:
        parts, part_shape, part_numel = [(key, 0)], shape, param.numel()
    entries = {}
    for part_key, origin in parts:
        lo, hi = max(start, origin), min(end, origin + part_numel)
        if hi <= lo:
            continue
        sharded = ShardedTensor.from_rank_offsets_flat(
            part_key,
            flat[lo - start : hi - start],
            part_shape,
            *_tensor_parallel_offset(param),
            flattened_range=slice(lo - origin, hi - origin),
        )
        entries[part_key] = CheckpointableShardedTensor.from_sh_ten(sharded)
    return entries
