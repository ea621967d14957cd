"""bias + dropout + residual add, the tail of every attention and MLP sublayer (``bias_dropout_fusion``;
``--no-bias-dropout-fusion`` turns it off).

``get_bias_dropout_add(training, fused)`` returns ``f((x, bias), residual, prob) -> residual + dropout(x + bias)``
(``x`` and ``bias`` are first cast to the residual's dtype, so an fp32 residual stream stays fp32). The fused
functions are our Triton kernel on CUDA: one pass, the dropout mask drawn in-kernel from a seed and offset taken
from the CUDA generator (so ``get_cuda_rng_tracker().fork()`` governs it as it governs PyTorch's dropout), and
backward drawing the same mask again instead of storing it. On CPU they run the unfused PyTorch ops (see
``kernel_dispatch`` for why), so there the flag changes nothing.
"""

from typing import Optional, Tuple

import torch

from megatron.core.fusions.kernel_dispatch import cpu_body, use_triton

_FUSION, _FLAG = "bias_dropout_fusion", "--no-bias-dropout-fusion"


def _bias_dropout_add_func(x_with_bias, residual, prob, training):
    """``residual + dropout(x + bias)`` in PyTorch's ops (in place when nothing needs gradients, as in eval)."""
    x, bias = x_with_bias
    inplace = not training and not x.requires_grad and not residual.requires_grad
    inplace = inplace and (bias is None or not bias.requires_grad)
    if x.dtype != residual.dtype:
        x = x.to(residual.dtype)
        bias = bias.to(residual.dtype) if bias is not None else None
    if bias is not None:
        x = x.add_(bias) if inplace else x + bias
    out = torch.nn.functional.dropout(x, p=prob, training=training, inplace=inplace)
    return out.add_(residual) if inplace else residual + out


def _philox_seed_offset(device: torch.device, numel: int) -> Tuple[int, int]:
    """A seed and Philox offset for ``numel`` random numbers, consumed from the generator of ``device``: on CUDA the
    generator's seed and offset (advanced past the numbers used, as PyTorch's own random kernels advance it); on
    CPU (Triton's interpreter) a seed drawn from the CPU generator."""
    if device.type != "cuda":
        return int(torch.randint(0, 2**62, (1,)).item()), 0
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    seed, offset = generator.initial_seed(), generator.get_offset()
    generator.set_offset(offset + (numel + 3) // 4 * 4)
    return seed % 2**63, offset


class BiasDropoutAddFunction(torch.autograd.Function):
    """``residual + dropout(x + bias)`` through the Triton kernels (``bias`` None: no bias; ``prob`` 0: no dropout)."""

    @staticmethod
    def forward(ctx, x, bias, residual, prob: float):
        from megatron.core.fusions.kernels.bias_dropout import bias_dropout_add_forward

        x_flat = x.contiguous()
        seed, offset = _philox_seed_offset(x.device, x.numel()) if prob > 0.0 else (0, 0)
        flat_bias = bias.reshape(-1) if bias is not None else None
        out = bias_dropout_add_forward(x_flat, flat_bias, residual.contiguous(), prob, seed, offset)
        ctx.rng, ctx.prob, ctx.has_bias = (seed, offset), prob, bias is not None
        ctx.x_dtype = x.dtype
        ctx.bias_dtype, ctx.bias_shape = (bias.dtype, bias.shape) if bias is not None else (None, None)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.fusions.kernels.bias_dropout import dropout_backward

        grad_output = grad_output.contiguous()
        # The gradient of x + bias, in the residual's dtype (the dtype the sum was taken in).
        grad_sum = grad_output
        if ctx.prob > 0.0:
            grad_sum = dropout_backward(grad_output, ctx.prob, *ctx.rng)
        grad_bias = None
        if ctx.has_bias:
            rows = grad_sum.reshape(-1, grad_sum.shape[-1])
            grad_bias = rows.sum(0, dtype=torch.float32).to(ctx.bias_dtype).view(ctx.bias_shape)
        # Never the residual's gradient tensor itself: autograd may keep both as .grad and accumulate into one.
        grad_x = grad_sum.to(ctx.x_dtype, copy=grad_sum is grad_output)
        return grad_x, grad_bias, grad_output, None


def _fused(x_with_bias, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    x, bias = x_with_bias
    fits = x.shape == residual.shape and (bias is None or bias.numel() == x.shape[-1])
    if not fits or not use_triton(x, _FUSION, _FLAG):
        return cpu_body(_bias_dropout_add_func)(x_with_bias, residual, prob, training)
    return BiasDropoutAddFunction.apply(x, bias, residual, prob if training else 0.0)


def bias_dropout_add_unfused(training: bool):
    """The unfused function for this mode (``training`` applies dropout)."""

    def _bias_dropout_add(x_with_bias, residual, prob):
        return _bias_dropout_add_func(x_with_bias, residual, prob, training)

    return _bias_dropout_add


def bias_dropout_add_fused_train(
    x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]], residual: torch.Tensor, prob: float
) -> torch.Tensor:
    """``residual + dropout(x + bias)`` with dropout applied (training)."""
    return _fused(x_with_bias, residual, prob, True)


def bias_dropout_add_fused_inference(
    x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]], residual: torch.Tensor, prob: float
) -> torch.Tensor:
    """``residual + x + bias`` (no dropout: inference)."""
    return _fused(x_with_bias, residual, prob, False)


def get_bias_dropout_add(training: bool, fused: bool):
    """The bias-dropout-add function for this mode: the fused one (train or inference) or the unfused one."""
    if fused:
        return bias_dropout_add_fused_train if training else bias_dropout_add_fused_inference
    return bias_dropout_add_unfused(training)
