"""The FP8 linear: ``x @ w.T (+ b)`` with its three GEMMs on quantised operands, for Column/RowParallelLinear.

Inside an :func:`~megatron.core.fp8.recipe.fp8_autocast` region, :func:`fp8_linear_for` hands a parallel linear
layer this GEMM instead of its high-precision one. Each GEMM operand is quantised along its contraction dimension
as the recipe says: forward ``x`` and ``w`` (E4M3), input gradient ``dy @ w`` and weight gradient ``dy.T @ x`` with
``dy`` in the backward format (E5M2 under ``hybrid``). With ``fp8_wgrad=False`` the weight gradient is computed from
the unquantised ``dy`` and ``x``. Per-tensor amaxes (tensorwise, delayed) are max-reduced over the amax group, which
holds every tensor-parallel rank: a row-parallel input, a column-parallel weight and its output gradient are split
over them, and the scale must be the one of the whole tensor (the same on every rank and for every TP size).

The layer's communication stays what it is in high precision: under sequence parallelism the input is all-gathered
first (its gradient reduce-scattered), otherwise the input gradient is all-reduced where the layer asks for it.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from megatron.core.fp8.quantization import (
    BLOCKWISE_TILE,
    QuantizedTensor,
    quantize_blockwise,
    quantize_mxfp8,
    quantize_tensorwise,
    scaled_matmul,
)
from megatron.core.fp8.recipe import (
    GRAD_OUTPUT,
    INPUT,
    WEIGHT,
    DelayedScalingState,
    Fp8ScalingRecipe,
    active_fp8_region,
    reduce_amax,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.tensor_parallel.utils import group_size, resolve_tp_group


def quantize_operand(
    t: torch.Tensor,
    fp8_dtype: torch.dtype,
    recipe: Fp8ScalingRecipe,
    is_weight: bool,
    state: Optional[DelayedScalingState] = None,
    slot: int = INPUT,
    amax_group=None,
) -> QuantizedTensor:
    """``t`` (2-D, contraction dimension last) quantised per ``recipe``: one scale per tensor (``tensorwise``: its
    current amax, reduced over ``amax_group``; ``delayed``: ``state``'s scale for ``slot``), one E8M0 scale per 32
    elements (``mxfp8``), one float32 scale per 1x128 tile, or per 128x128 tile for a weight (``blockwise``)."""
    if recipe.recipe == "delayed":
        return state.quantize(slot, t, fp8_dtype, recipe, amax_group)
    if recipe.recipe == "tensorwise":
        amax = reduce_amax(t.detach().abs().amax().to(torch.float32), amax_group)
        return quantize_tensorwise(t, fp8_dtype, amax)
    if recipe.recipe == "mxfp8":
        return quantize_mxfp8(t, fp8_dtype)
    tile = (BLOCKWISE_TILE, BLOCKWISE_TILE) if is_weight else (1, BLOCKWISE_TILE)
    return quantize_blockwise(t, fp8_dtype, tile)


def _transposed(q: QuantizedTensor) -> QuantizedTensor:
    """The transpose of a per-tensor or square-tile quantised operand, its data contiguous (row-major)."""
    t = q.t()
    return QuantizedTensor(t.data.contiguous(), t.scale_inv, t.block)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, recipe, state, amax_group, gradient_accumulation_fusion, accumulate):
        x = input.reshape(-1, input.shape[-1])
        qx = quantize_operand(x, recipe.forward_dtype, recipe, False, state, INPUT, amax_group)
        qw = quantize_operand(weight, recipe.forward_dtype, recipe, True, state, WEIGHT, amax_group)
        output = scaled_matmul(qx, qw, input.dtype)
        if bias is not None:
            output = output + bias
        ctx.recipe, ctx.state, ctx.amax_group = recipe, state, amax_group
        ctx.gradient_accumulation_fusion, ctx.accumulate = gradient_accumulation_fusion, accumulate
        ctx.use_bias, ctx.input_shape = bias is not None, input.shape
        # Per-tensor and square-tile scales serve the backward GEMMs transposed; MXFP8 blocks and 1x128 tiles run
        # along the other dimension there, so those operands are quantised again from the high-precision tensor.
        per_tensor = recipe.recipe in ("tensorwise", "delayed")
        keep_fp8_input = per_tensor and recipe.fp8_wgrad
        saved_x = (qx.data, qx.scale_inv) if keep_fp8_input else (x, None)
        saved_w = (None, None) if recipe.recipe == "mxfp8" else (qw.data, qw.scale_inv)
        ctx.keep_fp8_input, ctx.weight_block = keep_fp8_input, qw.block
        ctx.save_for_backward(weight, *saved_x, *saved_w)
        return output.reshape(*input.shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        weight, x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        recipe, group = ctx.recipe, ctx.amax_group
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        dtype = recipe.backward_dtype
        per_tensor = recipe.recipe in ("tensorwise", "delayed")
        qdy = quantize_operand(dy, dtype, recipe, False, ctx.state, GRAD_OUTPUT, group)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            if recipe.recipe == "mxfp8":
                qw_t = quantize_operand(weight.t().contiguous(), recipe.forward_dtype, recipe, True)
            else:
                qw_t = _transposed(QuantizedTensor(w_data, w_scale, ctx.weight_block))
            grad_input = scaled_matmul(qdy, qw_t, grad_output.dtype).reshape(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            if not recipe.fp8_wgrad:
                grad_weight = dy.t().matmul(x_data.to(dy.dtype))
            else:
                qdy_t = _transposed(qdy) if per_tensor else quantize_operand(dy.t().contiguous(), dtype, recipe, False)
                if ctx.keep_fp8_input:
                    qx_t = _transposed(QuantizedTensor(x_data, x_scale))
                else:
                    qx_t = quantize_operand(x_data.t().contiguous(), recipe.forward_dtype, recipe, False)
                grad_weight = scaled_matmul(qdy_t, qx_t, weight.dtype)
            grad_weight = ctx.accumulate(ctx, weight, grad_weight)
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _no_accumulation(ctx, weight, grad_weight):
    return grad_weight


def fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    tp_group=None,
    *,
    recipe: Fp8ScalingRecipe,
    scaling_state: Optional[DelayedScalingState] = None,
    amax_group=None,
    accumulate_weight_grad: Callable = _no_accumulation,
) -> torch.Tensor:
    """``input @ weight.T + bias`` in FP8 per ``recipe``, with the column-parallel communication of
    ``linear_with_grad_accumulation_and_async_allreduce`` (same leading arguments). ``amax_group`` None reduces
    per-tensor amaxes over ``tp_group``; ``accumulate_weight_grad(ctx, weight, grad)`` is the layer's hook for
    gradient-accumulation fusion."""
    if recipe.recipe == "delayed" and scaling_state is None:
        raise ValueError("the delayed FP8 recipe needs the layer's DelayedScalingState (scaling_state)")
    group = resolve_tp_group(tp_group)
    if sequence_parallel and group_size(group) > 1:
        # The gather's backward reduce-scatters the input gradient, which also sums it over TP.
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
    elif allreduce_dgrad and group_size(group) > 1:
        input = copy_to_tensor_model_parallel_region(input, group=group)
    amax_group = group if amax_group is None else amax_group
    return _Fp8LinearFunction.apply(
        input, weight, bias, recipe, scaling_state, amax_group, gradient_accumulation_fusion, accumulate_weight_grad
    )


def fp8_linear_for(layer: torch.nn.Module, accumulate_weight_grad: Callable) -> Optional[Callable]:
    """The FP8 GEMM ``layer`` runs inside an FP8 region (``fp8_linear`` bound to the region's recipe and the
    layer's delayed-scaling state, created on first use), or None outside one."""
    region = active_fp8_region()
    if region is None:
        return None
    state = getattr(layer, "fp8_scaling_state", None)
    if region.recipe.recipe == "delayed" and state is None:
        state = layer.fp8_scaling_state = DelayedScalingState(region.recipe.amax_history_len)
    # Expert layers reduce over their own (expert tensor-parallel) group: ranks of the wider group hold other
    # experts, which may see no tokens and skip the GEMM (and so the reduction).
    amax_group = layer.tp_group if getattr(layer, "is_expert", False) else region.amax_group
    return functools.partial(
        fp8_linear,
        recipe=region.recipe,
        scaling_state=state,
        amax_group=amax_group,
        accumulate_weight_grad=accumulate_weight_grad,
    )


def fp8_extra_state(layer: torch.nn.Module):
    """What a linear layer puts in its ``_extra_state``: its delayed-scaling state, or None without one."""
    state = getattr(layer, "fp8_scaling_state", None)
    return None if state is None else state.state_dict()


def load_fp8_extra_state(layer: torch.nn.Module, extra_state) -> None:
    """Restore a layer's delayed-scaling state from its ``_extra_state``; anything else (None, Transformer
    Engine's serialized bytes, a layer without FP8) leaves the layer as it is."""
    state = getattr(layer, "fp8_scaling_state", None)
    if state is not None and isinstance(extra_state, dict) and "fp8_amax_history" in extra_state:
        state.load_state_dict(extra_state)
