"""Rotary position embeddings as one autograd function (``apply_rope_fusion``; ``--no-rope-fusion`` turns it off).

On CUDA our Triton kernel rotates query / key in one pass and backward applies the transposed rotation, keeping
nothing but the angles. On CPU, and for interleaved channel pairs (which the kernel does not take), the caller's
PyTorch code runs (``megatron.core.transformer.rope_utils``).
"""

import torch

from megatron.core.fusions.kernel_dispatch import fallback_notice, pytorch_instead, use_triton

_FUSION, _FLAG = "apply_rope_fusion", "--no-rope-fusion"


class FusedRoPEFunction(torch.autograd.Function):
    """Rotate ``t`` ``[positions, ..., head_dim]`` by ``cos`` / ``sin`` ``[positions, rot_dim]`` (non-interleaved)."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        from megatron.core.fusions.kernels.rope import rope

        ctx.save_for_backward(cos, sin)
        return rope(t.contiguous(), cos, sin)

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.fusions.kernels.rope import rope

        cos, sin = ctx.saved_tensors
        return rope(grad_output.contiguous(), cos, sin, backward=True), None, None


def fused_rope_available(t: torch.Tensor, rotary_interleaved: bool) -> bool:
    """Whether ``fused_apply_rotary_pos_emb`` runs our kernel for ``t`` (else the caller's PyTorch code runs)."""
    if rotary_interleaved:
        if t.device.type != "cpu":
            fallback_notice(_FUSION, pytorch_instead("no kernel for interleaved rotary channels", _FLAG))
        return False
    return use_triton(t, _FUSION, _FLAG)


def fused_apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``t`` ``[positions, ..., head_dim]`` with angles' ``cos`` / ``sin`` of shape ``[positions, rot_dim]``
    (any extra singleton axes are dropped); channels past ``rot_dim`` pass through. Runs the kernel: call it where
    ``fused_rope_available`` says so."""
    rot_dim = cos.shape[-1]
    cos = cos.reshape(-1, rot_dim).float().contiguous()
    sin = sin.reshape(-1, rot_dim).float().contiguous()
    return FusedRoPEFunction.apply(t, cos, sin)
