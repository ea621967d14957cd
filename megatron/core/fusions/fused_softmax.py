"""Scale + mask + softmax of attention scores (``masked_softmax_fusion``; ``--no-masked-softmax-fusion`` turns it off).

Megatron's module: three autograd functions (causal upper-triangular mask, a given boolean mask, no mask) and
``FusedScaleMaskSoftmax``, which runs them where ``is_kernel_available`` says so and its PyTorch softmax otherwise.
On CUDA the functions are our Triton kernel (one pass per row in fp32; backward from the saved probabilities). On
CPU the fused path runs the unfused PyTorch ops, measured fastest eagerly (see ``kernel_dispatch``), so there the
flag changes nothing; ``MEGATRON_LITE_COMPILE_FUSIONS=1`` compiles the fused math (``scaled_masked_softmax``).

Masked keys are left out of the softmax, and a row with every key masked gives zeros (as Megatron's CUDA kernels
do). The unfused path fills masked scores through ``mask_func`` (Megatron's ``attention_mask_func`` writes -10000,
whose exponential is exactly 0 next to any realistic score) and zeros fully masked rows too, so both paths agree.
"""

from typing import Optional, Union

import torch
import torch.nn as nn

from megatron.core.fusions.fused_flash_attention import sliding_window_mask
from megatron.core.fusions.kernel_dispatch import compile_cpu_fusions, cpu_body, use_triton
from megatron.core.transformer.enums import AttnMaskType

_FUSION, _FLAG = "masked_softmax_fusion", "--no-masked-softmax-fusion"
# One program holds a row of scores in registers; longer rows run the PyTorch softmax.
MAX_KERNEL_KEYS = 16384


def scaled_masked_softmax(
    input: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool = False
) -> torch.Tensor:
    """The fused math in PyTorch: ``softmax(input * scale)`` in fp32 over the keys that are not masked (``causal``:
    the keys after each query; ``mask``: True = masked), zeros for fully masked rows, in ``input``'s dtype."""
    x = input.float()
    if scale != 1.0:
        x = x * scale
    if causal:
        sq, sk = x.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    if mask is not None:
        x = x.masked_fill(mask, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if mask is not None and not causal:
        probs = probs.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return probs.to(input.dtype)


def _window_mask(sq: int, sk: int, window_size, device) -> Optional[torch.Tensor]:
    """Megatron's sliding-window mask (True = masked): queries aligned with the last ``sq`` keys, query ``i`` seeing
    keys ``j`` with ``-left <= j - (i + sk - sq) <= right`` (-1: unbounded)."""
    return sliding_window_mask(sq, sk, sk - sq, False, tuple(window_size), device)


def scaled_softmax_back(output_grads: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """The gradient of ``scaled_masked_softmax`` with respect to its input, from its output ``probs``."""
    grads = output_grads.float()
    y = probs.float()
    return (scale * y * (grads - (grads * y).sum(dim=-1, keepdim=True))).to(probs.dtype)


class _SoftmaxFunction(torch.autograd.Function):
    """The body of the three functions below, ``input`` ``[b, np, sq, sk]``: our Triton kernel where it can run,
    else the same math in PyTorch (so the functions also compute correctly on CPU tensors)."""

    @staticmethod
    def forward(ctx, input, mask, scale: float, causal: bool):
        ctx.triton = use_triton(input, _FUSION, _FLAG)
        if ctx.triton:
            from megatron.core.fusions.kernels.softmax import softmax_forward

            probs = softmax_forward(input.contiguous(), mask, scale, causal)
        else:
            probs = scaled_masked_softmax(input, mask, scale, causal)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, output_grads):
        (probs,) = ctx.saved_tensors
        if ctx.triton:
            from megatron.core.fusions.kernels.softmax import softmax_backward

            return softmax_backward(output_grads.contiguous(), probs, ctx.scale), None, None, None
        return scaled_softmax_back(output_grads, probs, ctx.scale), None, None, None


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Scale, causal (upper-triangular) mask, softmax of ``inputs`` ``[attn_batches, sq, sq]``."""

    @staticmethod
    def forward(ctx, inputs, scale):
        return _SoftmaxFunction.forward(ctx, inputs.unsqueeze(0), None, scale, True).squeeze(0)

    @staticmethod
    def backward(ctx, output_grads):
        return _SoftmaxFunction.backward(ctx, output_grads.unsqueeze(0))[0].squeeze(0), None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """Scale, mask (boolean, True = masked, broadcastable to ``inputs`` ``[b, np, sq, sk]``), softmax."""

    @staticmethod
    def forward(ctx, inputs, mask, scale):
        return _SoftmaxFunction.forward(ctx, inputs, mask, scale, False)

    @staticmethod
    def backward(ctx, output_grads):
        return _SoftmaxFunction.backward(ctx, output_grads)[0], None, None


class ScaledSoftmax(torch.autograd.Function):
    """Scale and softmax of ``inputs`` ``[b, np, sq, sk]`` (no mask)."""

    @staticmethod
    def forward(ctx, inputs, scale):
        return _SoftmaxFunction.forward(ctx, inputs, None, scale, False)

    @staticmethod
    def backward(ctx, output_grads):
        return _SoftmaxFunction.backward(ctx, output_grads)[0], None


class SoftmaxOne(nn.Module):
    """Softmax with an extra logit ``denominator_offset`` per head (attention sinks, "off by one"): softmax over
    ``[x, offset]`` with the extra slot dropped, for scores ``[b, np, sq, sk]`` and offsets ``[np]``."""

    def __init__(self, dim: Optional[int] = None, denominator_offset: Union[torch.Tensor, float] = 1.0) -> None:
        super().__init__()
        self.dim = dim
        self.denominator_offset = denominator_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sink = torch.as_tensor(self.denominator_offset, dtype=x.dtype, device=x.device)
        sink = sink.reshape(1, -1, 1, 1).expand(x.size(0), x.size(1), x.size(2), 1)
        return torch.softmax(torch.cat([x, sink], dim=-1), dim=-1)[..., :-1]


class FusedScaleMaskSoftmax(nn.Module):
    """Scale + mask + softmax of attention scores ``[b, np, sq, sk]``, with Megatron's constructor.

    ``input_in_fp16`` / ``input_in_bf16``: the scores' storage type (the unfused path then computes in fp32 when
    ``softmax_in_fp32`` and casts back); ``attn_mask_type``: with ``AttnMaskType.causal`` and no mask given, the
    causal mask is applied; ``scaled_masked_softmax_fusion``: run the fused functions where they can run;
    ``mask_func(scores, mask)``: how the unfused path fills masked scores; ``scale``: multiplies the scores first
    (None: 1); ``window_size``: a sliding window ``(left, right)`` replacing the mask.
    """

    def __init__(
        self,
        input_in_fp16,
        input_in_bf16,
        attn_mask_type,
        scaled_masked_softmax_fusion,
        mask_func,
        softmax_in_fp32,
        scale,
        window_size=None,
    ):
        super().__init__()
        if input_in_fp16 and input_in_bf16:
            raise ValueError("FusedScaleMaskSoftmax: input_in_fp16 and input_in_bf16 cannot both be set")
        if scale is not None and not softmax_in_fp32:
            raise ValueError("FusedScaleMaskSoftmax: a scale needs softmax_in_fp32=True (scaled fp16 scores overflow)")
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        self.window_size = window_size

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor], softmax_offset: Optional[torch.Tensor] = None):
        """Probabilities for ``input`` ``[b, np, sq, sk]``; ``mask`` (True = masked) may be None for causal or
        unmasked attention. ``softmax_offset`` (attention sinks) runs the PyTorch path."""
        if input.dim() != 4:
            raise ValueError(f"FusedScaleMaskSoftmax takes scores [b, np, sq, sk], got shape {tuple(input.shape)}")
        if softmax_offset is None and self.is_kernel_available(mask, *input.size()):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask, softmax_offset)

    def _causal(self, mask: Optional[torch.Tensor], sq: int) -> bool:
        """Whether the causal mask is generated here: a causal type and no mask given (a given mask is used as it
        is, on both paths; one query alone sees every key, as with a KV cache)."""
        return self.attn_mask_type == AttnMaskType.causal and mask is None and self.window_size is None and sq > 1

    def is_kernel_available(self, mask, b, np, sq, sk) -> bool:
        """Whether the fused path runs for these shapes: the fusion is on and a row fits the kernel
        (``sk <= MAX_KERNEL_KEYS``); a generated causal mask needs ``sq == sk``. (The device is checked when the
        functions run: on CPU they run their PyTorch body.)"""
        if not self.scaled_masked_softmax_fusion or not 0 < sk <= MAX_KERNEL_KEYS:
            return False
        return not self._causal(mask, sq) or sq == sk

    def forward_fused_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The fused functions (causal, masked by a given or sliding-window mask, or plain) where our kernel runs.
        Elsewhere eagerly the unfused ops, measured fastest on CPU (they fill the mask in place), or with
        ``MEGATRON_LITE_COMPILE_FUSIONS=1`` the fused math compiled."""
        triton = use_triton(input, _FUSION, _FLAG)
        if not triton and not compile_cpu_fusions():
            return self.forward_torch_softmax(input, mask)
        b, np, sq, sk = input.size()
        scale = self.scale if self.scale is not None else 1.0
        causal = self._causal(mask, sq)
        if self.window_size is not None:
            mask = _window_mask(sq, sk, self.window_size, input.device)
        if not triton:
            return cpu_body(scaled_masked_softmax)(input, mask, scale, causal)
        if causal:
            return ScaledUpperTriangMaskedSoftmax.apply(input.reshape(-1, sq, sk), scale).view(b, np, sq, sk)
        if mask is not None:
            return ScaledMaskedSoftmax.apply(input, mask, scale)
        return ScaledSoftmax.apply(input, scale)

    def forward_torch_softmax(self, input, mask, softmax_offset=None) -> torch.Tensor:
        """PyTorch's ops: upcast (fp16 / bf16 scores with ``softmax_in_fp32``), scale, ``mask_func``, softmax,
        zeros for fully masked rows, cast back."""
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        sq, sk = input.size(2), input.size(3)
        causal = self._causal(mask, sq)
        if self.window_size is not None:
            mask = _window_mask(sq, sk, self.window_size, input.device)
        elif causal:
            if sq != sk:
                raise ValueError(f"a generated causal mask needs sq == sk (self-attention), got sq={sq}, sk={sk}")
            mask = torch.ones(sq, sk, dtype=torch.bool, device=input.device).triu(1)
        scores = self.mask_func(input, mask) if mask is not None else input
        if softmax_offset is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            probs = SoftmaxOne(-1, softmax_offset.to(input.device))(scores)
        if mask is not None and not causal:  # the causal mask leaves every query its own key
            probs = probs.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs

    @staticmethod
    def get_batch_per_block(sq, sk, b, np):
        """Rows of scores one program of the kernel handles: 1 (Megatron's CUDA kernel packs several per block)."""
        return 1
