"""Communication across the tensor-parallel group as autograd functions (Megatron-Core's mappings).

Each public wrapper pairs a forward collective with the backward collective that makes the gradient right:

==============================================  ==========================  ==========================
wrapper                                         forward                     backward
==============================================  ==========================  ==========================
copy_to_tensor_model_parallel_region            identity                    all-reduce
reduce_from_tensor_model_parallel_region        all-reduce                  identity
scatter_to_tensor_model_parallel_region         split last dim              all-gather last dim
gather_from_tensor_model_parallel_region        all-gather last dim         split last dim
scatter_to_sequence_parallel_region             split dim 0                 all-gather dim 0
gather_from_sequence_parallel_region            all-gather dim 0            reduce-scatter (or split) dim 0
reduce_scatter_to_sequence_parallel_region      reduce-scatter dim 0        all-gather dim 0
all_gather_last_dim_from_tensor_parallel_region all-gather last dim         reduce-scatter last dim
reduce_scatter_last_dim_to_tensor_parallel_reg. reduce-scatter last dim     all-gather last dim
all_to_all                                      all-to-all dim 0            all-to-all back
all_to_all_sp2hp / all_to_all_hp2sp             [s/tp, h] <-> [s, h/tp]     the inverse exchange
==============================================  ==========================  ==========================

The sequence-parallel gather and reduce-scatter also take uneven per-rank sizes along dim 0
(``output_split_sizes`` / ``input_split_sizes``, as MoE token counts are), and can place the gathered tensor in
parallel_state's global memory buffer (``use_global_buffer``: the result is overwritten by the next such call).

Activations are ``[s, b, h]``: the sequence-parallel ops work on dim 0, the tensor-parallel ones on the last dim.
Every wrapper takes ``group=None`` (this rank's tensor-parallel group) and returns its input unchanged when the group
has one rank. Collectives write into fresh tensors: a gradient handed to backward may be shared with another branch
of the graph (a residual add passes one tensor to both), so reducing it in place would corrupt that branch.
"""

from typing import List

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import (
    all_gather_into_tensor,
    group_rank,
    group_size,
    reduce_scatter_tensor,
    resolve_tp_group,
    split_tensor_along_last_dim,
)


def _check_divisible(size: int, world_size: int, what: str, shape) -> None:
    if size % world_size != 0:
        raise ValueError(
            f"{what} of size {size} (tensor shape {tuple(shape)}) is not divisible by the tensor-parallel size "
            f"{world_size}; pad it or choose a TP size that divides it"
        )


# ---- collectives (callers have already skipped one-rank groups) ----------------------------------------------------


def _reduce(input_: torch.Tensor, group) -> torch.Tensor:
    # A fresh dense copy: reducing the caller's tensor in place could corrupt another branch (module docstring).
    output = input_.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(output, group=group)
    return output


def _split_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = group_size(group)
    _check_divisible(input_.size(-1), world_size, "last dimension", input_.shape)
    return split_tensor_along_last_dim(input_, world_size)[group_rank(group)].contiguous()


def _split_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = group_size(group)
    _check_divisible(input_.size(0), world_size, "dimension 0 (sequence)", input_.shape)
    local = input_.size(0) // world_size
    return input_[group_rank(group) * local : (group_rank(group) + 1) * local].contiguous()


def _start_gather_along_first_dim(input_: torch.Tensor, group):
    """Launch an all-gather along dim 0; returns ``(output, work)``: ``output`` is ready after ``work.wait()``."""
    output = torch.empty(
        (group_size(group) * input_.size(0),) + tuple(input_.shape[1:]), dtype=input_.dtype, device=input_.device
    )
    # Collectives read a dense buffer; a transposed or sliced input is copied first.
    work = all_gather_into_tensor(output, input_.contiguous(), group=group, async_op=True)
    return output, work


def _gather_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    output, work = _start_gather_along_first_dim(input_, group)
    work.wait()
    return output


def _gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    # Collectives concatenate along dim 0; re-cut that result into the ranks' pieces and join them on the last dim.
    stacked = _gather_along_first_dim(input_, group)
    return torch.cat(stacked.chunk(group_size(group), dim=0), dim=-1)


def _start_reduce_scatter_along_first_dim(input_: torch.Tensor, group):
    """Launch a reduce-scatter (sum) along dim 0; returns ``(output, work)`` like the all-gather above."""
    world_size = group_size(group)
    _check_divisible(input_.size(0), world_size, "dimension 0 (sequence)", input_.shape)
    output = torch.empty(
        (input_.size(0) // world_size,) + tuple(input_.shape[1:]), dtype=input_.dtype, device=input_.device
    )
    work = reduce_scatter_tensor(output, input_.contiguous(), group=group, async_op=True)
    return output, work


def _reduce_scatter_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    output, work = _start_reduce_scatter_along_first_dim(input_, group)
    work.wait()
    return output


def _gather_along_first_dim_uneven(input_: torch.Tensor, group, output_split_sizes: List[int]) -> torch.Tensor:
    """All-gather along dim 0 where rank i holds ``output_split_sizes[i]`` rows (one all-to-all: every rank sends
    its rows to everyone)."""
    if input_.size(0) != output_split_sizes[group_rank(group)]:
        raise ValueError(
            f"this rank holds {input_.size(0)} rows but output_split_sizes[{group_rank(group)}] is "
            f"{output_split_sizes[group_rank(group)]}"
        )
    world_size = group_size(group)
    replicated = input_.contiguous().repeat((world_size,) + (1,) * (input_.dim() - 1))
    return _all_to_all(replicated, group, list(output_split_sizes), [input_.size(0)] * world_size)


def _reduce_scatter_along_first_dim_uneven(input_: torch.Tensor, group, input_split_sizes: List[int]) -> torch.Tensor:
    """Sum over ranks and keep ``input_split_sizes[rank]`` rows of dim 0: each rank receives every rank's copy of
    its rows and adds them up."""
    if input_.size(0) != sum(input_split_sizes):
        raise ValueError(f"input has {input_.size(0)} rows but input_split_sizes sum to {sum(input_split_sizes)}")
    world_size = group_size(group)
    mine = input_split_sizes[group_rank(group)]
    received = _all_to_all(input_, group, [mine] * world_size, list(input_split_sizes))
    # Rows arrive grouped by source rank, each block that rank's partial values of our rows: sum the blocks.
    return received.view((world_size, mine) + tuple(input_.shape[1:])).sum(dim=0)


def _gather_into_global_buffer(input_: torch.Tensor, group) -> torch.Tensor:
    from megatron.core import parallel_state

    shape = (group_size(group) * input_.size(0),) + tuple(input_.shape[1:])
    output = parallel_state.get_global_memory_buffer().get_tensor(shape, input_.dtype, "mpu")
    all_gather_into_tensor(output, input_.contiguous(), group=group)
    return output


def _reduce_scatter_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = group_size(group)
    _check_divisible(input_.size(-1), world_size, "last dimension", input_.shape)
    # Collectives cut along dim 0: move each rank's last-dim piece to the front, reduce-scatter, and restore.
    pieces = torch.stack(input_.chunk(world_size, dim=-1), dim=0)
    output = _reduce_scatter_along_first_dim(pieces.reshape((-1,) + tuple(pieces.shape[2:])), group)
    return output.view(input_.shape[:-1] + (input_.size(-1) // world_size,))


def _all_to_all(input_: torch.Tensor, group, output_split_sizes, input_split_sizes) -> torch.Tensor:
    rows = input_.size(0) if output_split_sizes is None else sum(output_split_sizes)
    output = torch.empty((rows,) + tuple(input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    dist.all_to_all_single(
        output,
        input_.contiguous(),
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
    )
    return output


# ---- autograd functions: forward(ctx, input_, group, ...) -----------------------------------------------------------


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce the gradient (each rank holds a partial gradient of the replicated input)."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce forward (sum of partial outputs); the gradient of a sum passes through unchanged."""

    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; gather the gradient back."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension; each rank keeps its slice of the gradient."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the sequence (dim 0); gather the gradient back."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence (dim 0), optionally with uneven per-rank sizes or into the global buffer.

    Backward: when the consumer is tensor-parallel (``tensor_parallel_output_grad``), each rank's gradient for the
    whole sequence is partial, so reduce-scatter it; otherwise every rank already has the full gradient and keeps
    its slice.
    """

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad, output_split_sizes, use_global_buffer):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.output_split_sizes = output_split_sizes
        if output_split_sizes is not None:
            return _gather_along_first_dim_uneven(input_, group, output_split_sizes)
        if use_global_buffer:
            return _gather_into_global_buffer(input_, group)
        return _gather_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        sizes = ctx.output_split_sizes
        if ctx.tensor_parallel_output_grad:
            if sizes is not None:
                grad_input = _reduce_scatter_along_first_dim_uneven(grad_output, ctx.group, sizes)
            else:
                grad_input = _reduce_scatter_along_first_dim(grad_output, ctx.group)
        elif sizes is not None:
            # This rank's rows follow those of every lower rank in the gathered tensor.
            start = sum(sizes[: group_rank(ctx.group)])
            grad_input = grad_output[start : start + sizes[group_rank(ctx.group)]].contiguous()
        else:
            grad_input = _split_along_first_dim(grad_output, ctx.group)
        return grad_input, None, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sum partial outputs and keep this rank's slice of the sequence (uneven with ``input_split_sizes``); gather the
    gradient back."""

    @staticmethod
    def forward(ctx, input_, group, input_split_sizes, use_global_buffer):
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        ctx.use_global_buffer = use_global_buffer
        if input_split_sizes is not None:
            return _reduce_scatter_along_first_dim_uneven(input_, group, input_split_sizes)
        return _reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.input_split_sizes is not None:
            grad_input = _gather_along_first_dim_uneven(grad_output, ctx.group, ctx.input_split_sizes)
        elif ctx.use_global_buffer:
            grad_input = _gather_into_global_buffer(grad_output, ctx.group)
        else:
            grad_input = _gather_along_first_dim(grad_output, ctx.group)
        return grad_input, None, None, None


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the last dimension; the gradient is reduce-scattered (every rank's gradient is partial)."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_along_last_dim(grad_output, ctx.group), None


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Sum partial results and keep this rank's slice of the last dimension; the gradient is all-gathered."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 with optional uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, input_, group, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return _all_to_all(input_, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        # The reverse exchange: what arrived from rank i goes back to rank i.
        grad_input = _all_to_all(grad_output, ctx.group, ctx.input_split_sizes, ctx.output_split_sizes)
        return grad_input, None, None, None


# ---- public wrappers ------------------------------------------------------------------------------------------------


def _apply(function, input_: torch.Tensor, group, *args) -> torch.Tensor:
    group = resolve_tp_group(group)
    # One rank: every collective is the identity, so skip the autograd function altogether.
    if group_size(group) == 1:
        return input_
    return function.apply(input_, group, *args)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient."""
    return _apply(_CopyToModelParallelRegion, input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce (sum) forward, identity backward."""
    return _apply(_ReduceFromModelParallelRegion, input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; the gradient is all-gathered."""
    return _apply(_ScatterToModelParallelRegion, input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dimension; the gradient is split back."""
    return _apply(_GatherFromModelParallelRegion, input_, group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0); the gradient is all-gathered."""
    return _apply(_ScatterToSequenceParallelRegion, input_, group)


def gather_from_sequence_parallel_region(
    input_, tensor_parallel_output_grad=True, group=None, output_split_sizes=None, use_global_buffer=False
):
    """All-gather the sequence (dim 0).

    The gradient is reduce-scattered when ``tensor_parallel_output_grad`` (the gathered tensor feeds a
    tensor-parallel layer, so each rank's gradient is partial) and split otherwise. ``output_split_sizes[i]`` is
    the number of rows rank i contributes (None: equal). With ``use_global_buffer`` the result lives in
    parallel_state's global memory buffer and is overwritten by the next call that uses it.
    """
    return _apply(
        _GatherFromSequenceParallelRegion,
        input_,
        group,
        tensor_parallel_output_grad,
        output_split_sizes,
        use_global_buffer,
    )


def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None, use_global_buffer=False):
    """Sum partial results over the group and keep this rank's slice of the sequence (dim 0).

    ``input_split_sizes[i]`` is the number of rows rank i keeps (None: equal). ``use_global_buffer`` places the
    gradient's all-gather in the global memory buffer.
    """
    return _apply(_ReduceScatterToSequenceParallelRegion, input_, group, input_split_sizes, use_global_buffer)


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """All-gather along the last dimension; the gradient is reduce-scattered back along it."""
    return _apply(_AllGatherFromTensorParallelRegion, input_, group)


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """Sum partial results and keep this rank's slice of the last dimension; the gradient is all-gathered."""
    return _apply(_ReduceScatterToTensorParallelRegion, input_, group)


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, use_nccl_stream=False):
    """All-to-all along dim 0 over ``group`` (required, as in Megatron: there is no sensible default group).

    ``input_split_sizes[i]`` rows go to rank i and ``output_split_sizes_[i]`` rows arrive from it; ``None`` means
    equal splits. ``use_nccl_stream`` (run on NCCL's own CUDA stream) is a scheduling knob, accepted and not used.
    """
    if group is None:
        raise ValueError("all_to_all needs an explicit process group (got group=None)")
    if group_size(group) == 1:
        return input_
    return _AllToAll.apply(input_, group, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_, group=None):
    """Sequence-parallel to hidden-parallel: ``[num_tokens / tp, H]`` -> ``[num_tokens, H / tp]``.

    Rank r sends the r-th slice of its hidden dimension to every rank and receives every rank's tokens for it.
    """
    group = resolve_tp_group(group)
    world_size = group_size(group)
    if world_size == 1:
        return input_
    hidden = input_.size(-1)
    _check_divisible(hidden, world_size, "last dimension", input_.shape)
    flat = input_.reshape(-1, hidden)
    # Row block i of the exchanged tensor goes to rank i: put hidden slice i of every token there.
    send = torch.cat(flat.chunk(world_size, dim=-1), dim=0)
    return all_to_all(group, send)


def all_to_all_hp2sp(input_, group=None):
    """Hidden-parallel to sequence-parallel: ``[num_tokens, H / tp]`` -> ``[num_tokens / tp, H]`` (inverse of
    :func:`all_to_all_sp2hp`)."""
    group = resolve_tp_group(group)
    world_size = group_size(group)
    if world_size == 1:
        return input_
    flat = input_.reshape(-1, input_.size(-1))
    _check_divisible(flat.size(0), world_size, "dimension 0 (tokens)", input_.shape)
    received = all_to_all(group, flat)
    # Row block i now holds this rank's tokens' hidden slice i: put the slices side by side.
    return torch.cat(received.chunk(world_size, dim=0), dim=-1)
