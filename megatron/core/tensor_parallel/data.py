"""Tensor-parallel rank 0 reads a batch and sends it to the other ranks of its TP group.

:func:`broadcast_data` makes two broadcasts: first the shapes (a fixed-size int64 tensor, so receivers know how much
to expect), then all the tensors flattened into one buffer. :func:`get_batch_on_this_tp_rank` sends a micro-batch
of known shapes, only the tensors each pipeline stage uses.
"""

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.public_api import public_api
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


@public_api("megatron.core.utils")
def get_batch_on_this_tp_rank(
    batch: dict[str, torch.Tensor],
    has_cu_seqlens: bool,
    is_hybrid_cp: bool,
    create_attention_mask_in_dataloader: bool,
    broadcast_src_rank: int,
    broadcast_group: dist.ProcessGroup,
    cp_size: int,
    tp_rank: int,
    micro_batch_size: int,
    seq_length: int,
    mtp_on_this_rank: bool,
    pipeline_model_parallel_size: int = 1,
    is_pipeline_first_stage: bool = False,
    is_pipeline_last_stage: bool = False,
):
    """Give every rank of ``broadcast_group`` the micro-batch that tensor-parallel rank 0 read.

    On ``tp_rank == 0`` ``batch`` holds ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (``[mbs, seq]``) and,
    with ``create_attention_mask_in_dataloader``, ``attention_mask`` (``[mbs, 1, seq, seq]`` bool); the other ranks'
    ``batch`` is ignored and the tensors are received from global rank ``broadcast_src_rank``. Only what a stage
    uses is sent: everything without pipeline parallelism; tokens and positions on the first stage; labels and the
    loss mask on the last (and tokens and positions too where an MTP block runs, ``mtp_on_this_rank``); the mask on
    both; middle stages get Nones. With ``has_cu_seqlens`` the packed-sequence boundaries ``cu_seqlens`` (int32) and
    ``max_seqlen`` are sent as well. The broadcast happens before the context-parallel split, so ``cp_size`` does
    not change what is sent; hybrid context parallelism is not supported yet.
    """
    if is_hybrid_cp:
        raise ValueError("not supported yet: hybrid context parallelism (is_hybrid_cp=True)")
    device = get_current_device()
    first = pipeline_model_parallel_size == 1 or is_pipeline_first_stage
    last = pipeline_model_parallel_size == 1 or is_pipeline_last_stage
    wanted = set()
    if first or (last and mtp_on_this_rank):
        wanted |= {"tokens", "position_ids"}
    if last:
        wanted |= {"labels", "loss_mask"}
    if (first or last) and create_attention_mask_in_dataloader:
        wanted.add("attention_mask")
    shapes = {
        "tokens": ((micro_batch_size, seq_length), torch.int64),
        "labels": ((micro_batch_size, seq_length), torch.int64),
        "loss_mask": ((micro_batch_size, seq_length), torch.float32),
        "position_ids": ((micro_batch_size, seq_length), torch.int64),
        "attention_mask": ((micro_batch_size, 1, seq_length, seq_length), torch.bool),
    }
    is_source = tp_rank == 0
    result: Dict[str, Optional[torch.Tensor]] = {}
    for key, (shape, dtype) in shapes.items():
        if key not in wanted:
            result[key] = None
            continue
        if is_source:
            tensor = batch[key].to(device=device, dtype=dtype, non_blocking=True).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, broadcast_src_rank, group=broadcast_group)
        result[key] = tensor
    if has_cu_seqlens:
        length = torch.tensor([batch["cu_seqlens"].numel() if is_source else 0], dtype=torch.int64, device=device)
        dist.broadcast(length, broadcast_src_rank, group=broadcast_group)
        if is_source:
            cu_seqlens = batch["cu_seqlens"].to(device=device, dtype=torch.int32).reshape(-1).contiguous()
            max_seqlen = torch.as_tensor(batch["max_seqlen"], dtype=torch.int32, device=device).reshape(1)
        else:
            cu_seqlens = torch.empty(int(length.item()), dtype=torch.int32, device=device)
            max_seqlen = torch.empty(1, dtype=torch.int32, device=device)
        dist.broadcast(cu_seqlens, broadcast_src_rank, group=broadcast_group)
        dist.broadcast(max_seqlen, broadcast_src_rank, group=broadcast_group)
        result["cu_seqlens"] = cu_seqlens
        result["max_seqlen"] = max_seqlen
    return result
