"""Which implementation ``--attention-backend`` (``TransformerConfig.attention_backend``) runs for core attention.

Megatron 0.19 maps ``flash`` / ``fused`` / ``unfused`` / ``auto`` to Transformer Engine's three attention kernels
(``auto`` lets TE choose among all three) and ``local`` to Megatron's own explicit attention. Here:

- ``unfused`` and ``local``: the explicit path (scores, then mask and softmax through ``FusedScaleMaskSoftmax``,
  dropout, values; on CPU bit for bit
  :func:`~megatron.core.fusions.fused_flash_attention.attention_reference`). Every feature; materialises the
  ``[b, heads, sq, sk]`` scores.
- ``fused``: PyTorch's ``scaled_dot_product_attention`` (its flash / memory-efficient / cuDNN kernels on CUDA, the
  fused flash kernel on CPU). A sliding window runs one query chunk at a time over the keys it reaches
  (``DotProductAttention._sdpa_window_chunks``), with a small mask per chunk.
- ``flash``: a flash kernel that never materialises a mask of its own: SDPA without a window; with a window the
  Triton flash kernel of ours (:mod:`megatron.core.fusions.fused_flash_attention`), which needs CUDA (or the Triton
  interpreter) and has no dropout; a config it cannot serve is refused when the model is built.
- ``auto`` (the default): SDPA, and the Triton kernel for sliding windows where it can run (CUDA, no attention
  dropout, no caller mask); otherwise SDPA as ``fused`` runs it. Always correct, never an error.

A caller that hands in an ``attention_mask`` or ``attention_bias`` has materialised it already, so ``flash`` and
``auto`` give such calls to SDPA. Context parallelism and inference go through the same choice (see
``docs/attention-backends.md`` for what each CP communication type runs).
"""

from typing import Optional, Tuple

import torch

from megatron.core.fusions.fused_flash_attention import flash_attention_supported
from megatron.core.transformer.enums import AttnBackend

UNFUSED = "unfused"
SDPA = "sdpa"
TRITON = "triton"

_EXPLICIT = (AttnBackend.unfused, AttnBackend.local)


def check_attention_backend(
    backend: AttnBackend, window_size: Optional[Tuple[int, int]], dropout_p: float, device: torch.device
) -> None:
    """Refuse a backend that cannot serve this layer's config, naming the flag and what to use instead."""
    if backend is not AttnBackend.flash or window_size is None or device.type == "meta":
        return  # a model built on the meta device (checkpoint converters) never runs attention
    if not flash_attention_supported(device):
        raise ValueError(
            f"--attention-backend flash (attention_backend=flash) runs sliding-window attention "
            f"(--window-size {window_size[0]},{window_size[1]}) with the Triton flash kernel, which needs a CUDA "
            f"device and triton (device here: {device.type}); use --attention-backend auto, fused or unfused"
        )
    if dropout_p > 0.0:
        raise ValueError(
            f"--attention-backend flash (attention_backend=flash) runs sliding-window attention with the Triton "
            f"flash kernel, which has no attention dropout (--attention-dropout {dropout_p}); set "
            "--attention-dropout 0 or use --attention-backend auto, fused or unfused"
        )


def select_implementation(
    backend: AttnBackend,
    window_size: Optional[Tuple[int, int]],
    device: torch.device,
    dropout_p: float,
    caller_mask: bool,
) -> str:
    """``UNFUSED``, ``SDPA`` or ``TRITON`` for one call (``caller_mask``: an attention_mask or bias was passed)."""
    if backend in _EXPLICIT:
        return UNFUSED
    if backend is AttnBackend.fused or window_size is None or caller_mask:
        return SDPA
    if dropout_p == 0.0 and flash_attention_supported(device):
        return TRITON
    return SDPA
