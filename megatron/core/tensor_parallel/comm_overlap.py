"""Tensor-parallel communication overlap (``tp_comm_overlap``) with asynchronous collectives, in pure PyTorch.

Under sequence parallelism each column-parallel linear all-gathers its ``[s/tp, b, h]`` input before its GEMM, and
each row-parallel linear reduce-scatters its GEMM's output to ``[s/tp, b, h]``. Megatron hides these collectives
behind the GEMMs with Transformer Engine's userbuffers; here the same schedule is built from ``async_op=True``
collectives, so it runs on CPU with gloo as well as on GPUs with NCCL:

- all-gather then GEMM (``tp_comm_overlap_ag``: column-parallel forward, row-parallel backward): the input is
  gathered in sequence chunks, all launched at once; this rank's own rows are multiplied while they travel, then
  each chunk's rows from the other ranks as soon as that chunk has arrived;
- GEMM then reduce-scatter (``tp_comm_overlap_rs``: row-parallel forward; ``tp_comm_overlap_rs_dgrad``: the
  column-parallel input gradient): the output is computed chunk by chunk and each chunk's reduce-scatter is launched
  while the next chunk is computed;
- bulk overlaps in the column-parallel backward: the re-gather of the input runs during the input-gradient GEMM
  (``tp_comm_bulk_wgrad``) and the input gradient's reduce-scatter during the weight-gradient GEMM
  (``tp_comm_bulk_dgrad``).

A chunk is a range of sequence positions on every rank, and each chunk's GEMM writes its rows of the output in place.
GEMM rows are independent, so the results equal the non-overlapped path's (bitwise on CPU at TP2, which the tests
check; on a GPU a BLAS library may pick another kernel for a smaller GEMM, so expect rounding-level differences).
Only the transformer layers' linears (those built with a ``tp_comm_buffer_name``: qkv, proj, fc1, fc2) overlap, as
in Megatron, where the output layer and the MoE experts are not Transformer Engine userbuffer layers either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _start_gather_along_first_dim,
    _start_reduce_scatter_along_first_dim,
)
from megatron.core.tensor_parallel.utils import group_rank, group_size, reduce_scatter_tensor

# Megatron's default userbuffers configuration pipelines a GEMM in 4 splits; fewer when the sequence is shorter.
DEFAULT_NUM_SPLITS = 4


@dataclass(frozen=True)
class TPCommOverlap:
    """What one linear layer overlaps (from the config's ``tp_comm_*`` fields), over which group.

    ``weight_grad(ctx, weight, grad_output_2d, total_input)`` is layers.py's weight-gradient step (fused into
    ``main_grad`` when ``ctx.gradient_accumulation_fusion``), so both linear paths treat ``main_grad`` alike.
    """

    ag: bool
    rs: bool
    rs_dgrad: bool
    bulk_wgrad: bool
    bulk_dgrad: bool
    group: dist.ProcessGroup
    gradient_accumulation_fusion: bool
    weight_grad: Callable
    num_splits: int = DEFAULT_NUM_SPLITS


def tp_comm_overlap_for(layer, tp_comm_buffer_name: Optional[str], weight_grad) -> Optional[TPCommOverlap]:
    """The overlaps of a tensor-parallel ``layer`` named ``tp_comm_buffer_name`` (``qkv``, ``proj``, ``fc1``,
    ``fc2``), or None when ``config.tp_comm_overlap`` is off, the layer is not sequence-parallel, or it has no name
    (the output layer) or leaves its communication to the MoE dispatcher."""
    config = layer.config
    if not (config.tp_comm_overlap and layer.sequence_parallel) or layer.explicit_expert_comm:
        return None
    if tp_comm_buffer_name is None:  # as in Megatron, where only Transformer Engine's layers overlap
        return None
    disabled_gather = (tp_comm_buffer_name == "qkv" and config.tp_comm_overlap_disable_qkv) or (
        tp_comm_buffer_name == "fc1" and config.tp_comm_overlap_disable_fc1
    )
    return TPCommOverlap(
        ag=config.tp_comm_overlap_ag and not disabled_gather,
        rs=config.tp_comm_overlap_rs,
        rs_dgrad=config.tp_comm_overlap_rs_dgrad,
        bulk_wgrad=config.tp_comm_bulk_wgrad,
        bulk_dgrad=config.tp_comm_bulk_dgrad,
        group=layer.tp_group,
        gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        weight_grad=weight_grad,
    )


# ---- the two chunked schedules -------------------------------------------------------------------------------------


class _Pending:
    """Launched collectives and the buffers they read, kept alive until ``wait``."""

    def __init__(self):
        self.works: List[Tuple[dist.Work, torch.Tensor]] = []

    def wait(self) -> None:
        for work, _ in self.works:
            work.wait()
        self.works.clear()


def _num_chunks(rows: int, num_splits: int) -> int:
    """The largest chunk count up to ``num_splits`` that divides ``rows`` evenly."""
    return next(k for k in range(min(num_splits, rows), 0, -1) if rows % k == 0)


def _gemm_into(out: torch.Tensor, rows: torch.Tensor, rhs: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """``out = rows @ rhs (+ bias)`` over the leading dims flattened, written into ``out`` (a dense slice)."""
    rows_2d = rows.reshape(-1, rows.size(-1))
    out_2d = out.view(-1, out.size(-1))
    # The same ATen ops F.linear runs (addmm with a bias, mm without), so every row rounds as it would there.
    if bias is None:
        torch.mm(rows_2d, rhs, out=out_2d)
    else:
        torch.addmm(bias, rows_2d, rhs, out=out_2d)


def gather_then_gemm(
    local: torch.Tensor, rhs: torch.Tensor, bias: Optional[torch.Tensor], group, num_splits: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``all_gather(local, dim 0) @ rhs (+ bias)`` with the gather overlapped with the GEMM.

    ``local`` is this rank's ``[s/tp, ..., h]``; returns ``(output [s, ..., n], gathered [s, ..., h])``.
    """
    tp, rank = group_size(group), group_rank(group)
    local = local.contiguous()
    rows = local.size(0)
    chunk = rows // _num_chunks(rows, num_splits)
    gathered = torch.empty((tp,) + tuple(local.shape), dtype=local.dtype, device=local.device)
    output = torch.empty((tp,) + tuple(local.shape[:-1]) + (rhs.size(1),), dtype=local.dtype, device=local.device)
    works = []
    for start in range(0, rows, chunk):
        # Each rank's rows of this chunk land in place in the [tp, s/tp, ...] layout of the gathered tensor.
        pieces = [gathered[r, start : start + chunk] for r in range(tp)]
        works.append(dist.all_gather(pieces, local[start : start + chunk], group=group, async_op=True))
    _gemm_into(output[rank], local, rhs, bias)  # this rank's rows need nothing from the others
    for start, work in zip(range(0, rows, chunk), works):
        work.wait()
        for r in range(tp):
            if r != rank:
                _gemm_into(output[r, start : start + chunk], gathered[r, start : start + chunk], rhs, bias)
    flat = (tp * rows,) + tuple(local.shape[1:-1])
    return output.view(flat + (rhs.size(1),)), gathered.view(flat + (local.size(-1),))


def start_gemm_then_reduce_scatter(
    full: torch.Tensor, rhs: torch.Tensor, group, num_splits: int
) -> Tuple[torch.Tensor, _Pending]:
    """Launch ``reduce_scatter(full @ rhs, dim 0)`` chunk by chunk, each chunk's collective running while the next
    chunk's GEMM computes. Returns ``(output [s/tp, ..., n], pending)``: the output is ready after
    ``pending.wait()``."""
    tp = group_size(group)
    rows = full.size(0) // tp
    chunk = rows // _num_chunks(rows, num_splits)
    per_rank = full.reshape((tp, rows) + tuple(full.shape[1:]))
    out_shape = tuple(full.shape[1:-1]) + (rhs.size(1),)
    output = torch.empty((rows,) + out_shape, dtype=full.dtype, device=full.device)
    pending = _Pending()
    for start in range(0, rows, chunk):
        # Rank r's rows of this chunk, one block per destination rank, as reduce_scatter splits its input.
        partial = torch.empty((tp, chunk) + out_shape, dtype=full.dtype, device=full.device)
        for r in range(tp):
            _gemm_into(partial[r], per_rank[r, start : start + chunk], rhs, None)
        work = reduce_scatter_tensor(
            output[start : start + chunk], partial.view((tp * chunk,) + out_shape), group=group, async_op=True
        )
        pending.works.append((work, partial))
    return output, pending


# ---- the linear layers' autograd functions -------------------------------------------------------------------------


class ColumnParallelLinearWithCommOverlap(torch.autograd.Function):
    """A sequence-parallel column-parallel linear: ``all_gather(input) @ weight.T + bias`` (module docstring)."""

    @staticmethod
    def forward(ctx, input, weight, bias, overlap: TPCommOverlap):
        group = overlap.group
        ctx.use_bias = bias is not None
        ctx.overlap = overlap
        ctx.gradient_accumulation_fusion = overlap.gradient_accumulation_fusion
        ctx.save_for_backward(input, weight)  # only the local slice; backward gathers it again
        if overlap.ag:
            output, _ = gather_then_gemm(input, weight.t(), bias, group, overlap.num_splits)
            return output
        return torch.nn.functional.linear(_gather_along_first_dim(input, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        overlap, group = ctx.overlap, ctx.overlap.group
        wgrad_compute = ctx.needs_input_grad[1]
        gathered = gather_work = None
        if wgrad_compute:
            gathered, gather_work = _start_gather_along_first_dim(input_, group)
            if not overlap.bulk_wgrad:
                gather_work.wait()
        grad_input, reduce_pending = None, _Pending()
        if ctx.needs_input_grad[0]:
            if overlap.rs_dgrad:
                grad_input, reduce_pending = start_gemm_then_reduce_scatter(
                    grad_output, weight, group, overlap.num_splits
                )
            else:
                grad_input, work = _start_reduce_scatter_along_first_dim(grad_output.matmul(weight), group)
                reduce_pending.works.append((work, grad_input))
            if not overlap.bulk_dgrad:
                reduce_pending.wait()
        grad_weight = grad_bias = None
        grad_output_2d = grad_output.reshape(-1, grad_output.size(-1))
        if wgrad_compute:
            gather_work.wait()
            grad_weight = overlap.weight_grad(ctx, weight, grad_output_2d, gathered)
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output_2d.sum(dim=0)
        reduce_pending.wait()
        return grad_input, grad_weight, grad_bias, None


class RowParallelLinearWithCommOverlap(torch.autograd.Function):
    """A sequence-parallel row-parallel linear without bias: ``reduce_scatter(input @ weight.T)`` (see the module
    docstring; the bias is added by the layer after the reduction)."""

    @staticmethod
    def forward(ctx, input, weight, overlap: TPCommOverlap):
        group = overlap.group
        ctx.overlap = overlap
        ctx.gradient_accumulation_fusion = overlap.gradient_accumulation_fusion
        ctx.save_for_backward(input, weight)
        if overlap.rs:
            output, pending = start_gemm_then_reduce_scatter(input, weight.t(), group, overlap.num_splits)
            pending.wait()
            return output
        output, work = _start_reduce_scatter_along_first_dim(torch.nn.functional.linear(input, weight), group)
        work.wait()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        overlap, group = ctx.overlap, ctx.overlap.group
        if overlap.ag:
            grad_input, grad_output_full = gather_then_gemm(grad_output, weight, None, group, overlap.num_splits)
        else:
            grad_output_full = _gather_along_first_dim(grad_output, group)
            grad_input = grad_output_full.matmul(weight)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_output_2d = grad_output_full.reshape(-1, grad_output_full.size(-1))
            grad_weight = overlap.weight_grad(ctx, weight, grad_output_2d, input_)
        return grad_input, grad_weight, None
