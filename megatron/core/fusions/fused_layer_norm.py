"""LayerNorm / RMSNorm forward and backward as one autograd function: our Triton kernel on CUDA.

On CPU the PyTorch norms (``F.layer_norm``, ``F.rms_norm``) are already single fused ATen kernels, so they are the
CPU body as they are. The norms built by ``WrappedTorchNorm`` route through ``fused_norm`` when
``persist_layer_norm`` is set (Megatron-LM's default; ``--no-persist-layer-norm`` turns it off).
"""

import torch
import torch.nn.functional as F

from megatron.core.fusions.kernel_dispatch import fallback_notice, pytorch_instead, use_triton

_FUSION, _FLAG = "persist_layer_norm", "--no-persist-layer-norm"
# A row is held in registers by one program; wider rows use the PyTorch norms.
MAX_KERNEL_HIDDEN_SIZE = 16384


def _torch_norm(x, weight, bias, eps: float, is_rms: bool) -> torch.Tensor:
    shape = (x.shape[-1],)
    if is_rms:
        return F.rms_norm(x, shape, weight, eps)
    return F.layer_norm(x, shape, weight, bias, eps)


class FusedNormFunction(torch.autograd.Function):
    """LayerNorm (``is_rms=False``) or RMSNorm of ``x`` over its last axis through the Triton kernels."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, is_rms: bool):
        from megatron.core.fusions.kernels.norm import norm_forward

        flat = x.reshape(-1, x.shape[-1]).contiguous()
        y, mean, rstd = norm_forward(flat, weight, bias, eps, is_rms)
        ctx.save_for_backward(flat, weight, mean, rstd)
        ctx.is_rms, ctx.shape, ctx.has_bias = is_rms, x.shape, bias is not None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.fusions.kernels.norm import norm_backward

        flat, weight, mean, rstd = ctx.saved_tensors
        dy = grad_output.reshape(flat.shape).contiguous()
        dx, dweight, dbias = norm_backward(dy, flat, weight, mean, rstd, ctx.is_rms)
        return dx.view(ctx.shape), dweight, dbias if ctx.has_bias else None, None, None


def fused_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, normalization: str):
    """``normalization`` ('LayerNorm' or 'RMSNorm') of ``x`` over its last axis with ``weight`` (and ``bias``)."""
    is_rms = normalization == "RMSNorm"
    if weight is None or not use_triton(x, _FUSION, _FLAG):
        return _torch_norm(x, weight, bias, eps, is_rms)
    if x.shape[-1] > MAX_KERNEL_HIDDEN_SIZE:
        reason = f"hidden size {x.shape[-1]} is wider than the kernel's {MAX_KERNEL_HIDDEN_SIZE}"
        fallback_notice(_FUSION, pytorch_instead(reason, _FLAG))
        return _torch_norm(x, weight, bias, eps, is_rms)
    return FusedNormFunction.apply(x, weight, bias, eps, is_rms)
