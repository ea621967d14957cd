"""broadcast_data: tensor-parallel rank 0 reads a batch and sends it to the other ranks of its TP group.

Two broadcasts: first the shapes (a fixed-size int64 tensor, so receivers know how much to expect), then all the
tensors flattened into one buffer.
"""

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import group_rank, group_size, resolve_tp_group
from megatron.core.utils import get_current_device

# Shapes travel in a fixed-size slot per key: a rank count then up to this many dimensions.
_MAX_DATA_DIM = 5


def _check_data(keys: Sequence[str], data: Dict[str, torch.Tensor], datatype: torch.dtype) -> None:
    for key in keys:
        if key not in data:
            raise KeyError(f"broadcast_data: key {key!r} is missing from data (it has {sorted(data)})")
        tensor = data[key]
        if tensor.dtype != datatype:
            raise TypeError(f"broadcast_data: {key!r} has dtype {tensor.dtype}, expected {datatype}; cast it first")
        if tensor.dim() > _MAX_DATA_DIM:
            raise ValueError(
                f"broadcast_data: {key!r} has {tensor.dim()} dimensions (shape {tuple(tensor.shape)}); "
                f"at most {_MAX_DATA_DIM} are supported"
            )


def _broadcast_shapes(keys: Sequence[str], data, group, src: int, is_source: bool) -> List[torch.Size]:
    slots = torch.zeros(len(keys), _MAX_DATA_DIM + 1, dtype=torch.int64, device=get_current_device())
    if is_source:
        for row, key in enumerate(keys):
            shape = data[key].shape
            slots[row, 0] = len(shape)
            slots[row, 1 : len(shape) + 1] = torch.tensor(shape, dtype=torch.int64)
    dist.broadcast(slots, src, group=group)
    return [torch.Size(row[1 : row[0] + 1].tolist()) for row in slots.cpu()]


def broadcast_data(
    keys: Sequence[str],
    data: Optional[Dict[str, torch.Tensor]],
    datatype: torch.dtype,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> Dict[str, torch.Tensor]:
    """Send ``data[key]`` for each key from TP rank 0 to its tensor-parallel group; return them on every rank.

    Only TP rank 0 reads ``data`` (other ranks may pass ``None``); every tensor must have dtype ``datatype``.
    The results live on the current device.
    """
    group = resolve_tp_group(tp_group)
    is_source = group_rank(group) == 0
    if is_source:
        _check_data(keys, data, datatype)
    if group_size(group) == 1:
        return {key: data[key].to(get_current_device()) for key in keys}

    src = dist.get_global_rank(group, 0)
    shapes = _broadcast_shapes(keys, data, group, src, is_source)
    if is_source:
        flat = torch.cat([data[key].reshape(-1) for key in keys]).to(get_current_device())
    else:
        flat = torch.empty(sum(shape.numel() for shape in shapes), dtype=datatype, device=get_current_device())
    dist.broadcast(flat, src, group=group)

    output, offset = {}, 0
    for key, shape in zip(keys, shapes):
        output[key] = flat.narrow(0, offset, shape.numel()).view(shape)
        offset += shape.numel()
    return output
