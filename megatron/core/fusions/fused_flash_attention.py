"""Flash attention (Dao et al. 2022) in Triton, forward and backward, for what PyTorch's SDPA cannot do in-kernel:
sliding windows and logit soft-capping without a materialised ``[s, s]`` mask, with grouped-query attention read in
place (no copied key/value heads) and the log-sum-exp of every query row returned (ring attention merges blocks by it).

Shapes: ``q`` ``[b, heads, sq, d]``, ``k``/``v`` ``[b, groups, sk, d]`` with ``heads % groups == 0``. Query ``i``
sits at key position ``i + q_offset`` (0: top-left alignment, ``sk - sq``: the queries continue a cached prefix).
Query position ``p`` sees key ``j`` when ``-left <= j - p <= right`` for ``window_size=(left, right)``, a negative bound
meaning unbounded (Megatron's convention); ``causal`` is ``right = 0``. With ``softcap > 0`` a score ``s`` becomes
``softcap * tanh(s / softcap)`` before the softmax (Gemma 2). No dropout: callers that need it take another backend.

:func:`attention_reference` is the eager twin (explicit scores, mask, softmax, dropout, values) that the kernel is
tested against and that the ``unfused`` attention backend runs. The kernel runs on CUDA, or anywhere under
``TRITON_INTERPRET=1`` (how the tests check it on CPU); :func:`flash_attention_supported` says whether it can run here.
"""

import os
from typing import Optional, Tuple

import torch

from megatron.core.fusions.kernel_dispatch import HAVE_TRITON  # triton is optional (the `gpu` extra)


def flash_attention_supported(device: torch.device) -> bool:
    """Whether :func:`flash_attention` can run on ``device``: Triton installed, and CUDA or the interpreter."""
    return HAVE_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def sliding_window_mask(
    sq: int, sk: int, q_offset: int, causal: bool, window_size: Optional[Tuple[int, int]], device
) -> Optional[torch.Tensor]:
    """``[sq, sk]`` True where query ``i`` must not see key ``j`` (the kernel's visibility rule), or None."""
    left, right = window_size if window_size is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left < 0 and right < 0:
        return None
    distance = torch.arange(sk, device=device)[None, :] - (torch.arange(sq, device=device)[:, None] + q_offset)
    masked = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        masked |= distance < -left
    if right >= 0:
        masked |= distance > right
    return masked


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    masked: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    softmax_in_fp32: bool = True,
) -> torch.Tensor:
    """Explicit attention: ``softmax(cap(q k^T * scale) + bias, masked -> -inf)``, dropout, times ``v``.

    ``masked`` broadcasts to ``[b, heads, sq, sk]`` (True = hidden); a fully hidden row gives zeros, as the kernels
    do. The softmax runs in fp32 when ``softmax_in_fp32`` (Megatron's ``attention_softmax_in_fp32``); the
    probabilities go back to the input dtype for the product with ``v``.
    """
    heads, groups = q.shape[1], k.shape[1]
    if heads != groups:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2))
    if softmax_in_fp32:
        scores = scores.float()
    scores = scores * softmax_scale
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if masked is not None:
        probs = probs.masked_fill(masked.all(dim=-1, keepdim=True), 0.0)  # hidden rows: 0, not NaN
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool = False,
    window_size: Optional[Tuple[int, int]] = None,
    softcap: float = 0.0,
    q_offset: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, heads, sq, d], lse [b, heads, sq] fp32)`` from the Triton kernel (see the module docstring)."""
    if not HAVE_TRITON:
        raise RuntimeError("flash_attention needs triton (pip install triton, or megatron-lite's `gpu` extra)")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    left, right = window_size if window_size is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    from megatron.core.fusions.kernels.flash_attention import FlashAttentionFunction

    return FlashAttentionFunction.apply(q, k, v, softmax_scale, (left, right), softcap, q_offset)
