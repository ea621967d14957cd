"""bias + SwiGLU (``silu(a) * b`` for ``[a; b] = y + bias``), with or without the bias, as one autograd function.

On CUDA it is our Triton kernel in an autograd function whose forward saves only the input (and bias): backward
recomputes the gate, so the activation's intermediates are never stored. On CPU the PyTorch functions below run under
autograd (see ``kernel_dispatch`` for why).
Used by the MLP when ``bias_activation_fusion`` is set with a gated SiLU (``--swiglu``; ``--no-bias-swiglu-fusion``
turns it off).
"""

import torch
import torch.nn.functional as F

from megatron.core.fusions.kernel_dispatch import cpu_body, use_triton

_FUSION, _FLAG = "bias_swiglu_fusion", "--no-bias-swiglu-fusion"


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(y1) * y2`` for the two halves of ``y``'s last axis."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    return F.silu(y_1) * y_2


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """SwiGLU of ``y + bias``."""
    return swiglu(y + bias)


def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of ``swiglu`` at ``y`` for the output gradient ``g`` (both halves, concatenated)."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    sig = torch.sigmoid(y_1)
    return torch.cat((g * sig * (1 + y_1 * (1 - sig)) * y_2, g * y_1 * sig), -1)


def bias_swiglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The gradient of ``bias_swiglu`` with respect to ``y`` (the bias gradient is its sum over tokens)."""
    return swiglu_back(g, y + bias)


def _forward(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if use_triton(y, _FUSION, _FLAG):
        from megatron.core.fusions.kernels.activations import swiglu_forward

        return swiglu_forward(y, bias)
    return swiglu(y) if bias is None else bias_swiglu(y, bias)


def _backward(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if use_triton(y, _FUSION, _FLAG):
        from megatron.core.fusions.kernels.activations import swiglu_backward

        return swiglu_backward(g.contiguous(), y, bias)
    return swiglu_back(g, y) if bias is None else bias_swiglu_back(g, y, bias)


class BiasSwiGLUFunction(torch.autograd.Function):
    """bias + SwiGLU of a 2-D input ``[tokens, 2 * ffn]``. ``fp8_input_store`` and ``cpu_offload_input`` are
    Megatron's memory options; they are accepted for compatibility and change nothing here."""

    @staticmethod
    def forward(ctx, input, bias, fp8_input_store=False, cpu_offload_input=False):
        input = input.contiguous()
        ctx.save_for_backward(input, bias)
        return _forward(input, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        grad = _backward(grad_output, input, bias)
        return grad, grad.sum(0, dtype=torch.float32).to(bias.dtype), None, None


class SwiGLUFunction(torch.autograd.Function):
    """SwiGLU of a 2-D input ``[tokens, 2 * ffn]`` without a bias (Llama's MLP)."""

    @staticmethod
    def forward(ctx, input, fp8_input_store=False, cpu_offload_input=False):
        input = input.contiguous()
        ctx.save_for_backward(input)
        return _forward(input, None)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        return _backward(grad_output, input, None), None, None


def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """bias + SwiGLU of a 2-D or 3-D input (``bias`` may be None), as one autograd function:
    ``[..., 2 * ffn] -> [..., ffn]``."""
    shape = input.shape
    if len(shape) not in (2, 3):
        raise ValueError(f"bias_swiglu_impl takes a 2-D or 3-D input, got shape {tuple(shape)}")
    input = input.reshape(-1, shape[-1])
    if not use_triton(input, _FUSION, _FLAG):
        output = cpu_body(swiglu)(input) if bias is None else cpu_body(bias_swiglu)(input, bias)
    elif bias is None:
        output = SwiGLUFunction.apply(input, fp8_input_store, cpu_offload_input)
    else:
        output = BiasSwiGLUFunction.apply(input, bias, fp8_input_store, cpu_offload_input)
    return output.view(*shape[:-1], shape[-1] // 2)
