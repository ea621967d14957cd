"""Attention over one block of keys at a time, and the log-sum-exp merge that makes the blocks add up to softmax.

A query block attends to a key block and returns its (unnormalised-across-blocks) output together with the
log-sum-exp ``lse`` of its scores. Two partial results over disjoint key sets merge exactly:

    lse = log(exp(lse_a) + exp(lse_b)),   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

so attention over a sequence can be computed one key block at a time (ring attention, Liu et al. 2023; the same
online softmax as FlashAttention, Dao et al. 2022). The backward of a block needs only the *final* ``lse`` and
``delta = rowsum(dout * out)``: ``P = exp(S - lse)`` is then the block's slice of the full softmax.

Shapes: grouped-query attention is handled by broadcasting, not by copying keys. Queries are
``[b, groups, heads_per_group, m, d]``, keys and values ``[b, groups, 1, l, d]``, masks ``[*, *, 1, m, l]`` (True =
masked out), outputs ``[b, groups, heads_per_group, m, d]`` and ``lse`` ``[b, groups, heads_per_group, m]``. Every
block is computed in fp32 (the inputs may be bf16), which is what keeps the blockwise result equal to the one-shot
softmax to rounding.

Dropout (on the probabilities, as in Megatron) draws one uniform tensor per block from the device generator; the
backward replays the blocks in the same order from the same generator state, so it sees the same masks without
storing them.
"""

from typing import Optional, Tuple

import torch

_NEG_INF = float("-inf")


def _finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    # A row whose keys are all masked has lse = -inf; subtracting 0 instead keeps its probabilities at exactly 0.
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _probabilities(q, k, masked, scale, lse):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, _NEG_INF)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - _finite_or_zero(lse).unsqueeze(-1)), lse


def _dropout_keep(probs: torch.Tensor, dropout_p: float) -> torch.Tensor:
    return (torch.rand_like(probs) >= dropout_p).to(probs.dtype) / (1.0 - dropout_p)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: Optional[torch.Tensor], scale: float, dropout_p: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` attending to one block ``k, v`` (fp32 inputs)."""
    probs, lse = _probabilities(q, k, masked, scale, None)
    if dropout_p > 0.0:
        probs = probs * _dropout_keep(probs, dropout_p)
    return torch.matmul(probs, v), lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's ``(block_out, block_lse)`` into the running ``(out, lse)``, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    reference = _finite_or_zero(new_lse)
    out.mul_(torch.exp(lse - reference).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - reference).unsqueeze(-1))
    lse.copy_(new_lse)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masked: Optional[torch.Tensor],
    scale: float,
    dropout_p: float,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the final ``lse`` and ``delta = rowsum(dout * out)`` of its queries.

    ``dk`` and ``dv`` are summed over the query heads that share a key/value head.
    """
    probs, _ = _probabilities(q, k, masked, scale, lse)
    dprobs = torch.matmul(dout, v.transpose(-1, -2))
    if dropout_p > 0.0:
        keep = _dropout_keep(probs, dropout_p)
        dv = torch.matmul((probs * keep).transpose(-1, -2), dout)
        dprobs = dprobs * keep
    else:
        dv = torch.matmul(probs.transpose(-1, -2), dout)
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(dscores, k)
    dk = torch.matmul(dscores.transpose(-1, -2), q)
    return dq, dk.sum(dim=2, keepdim=True), dv.sum(dim=2, keepdim=True)


# ---- the same two steps through PyTorch's fused CPU flash-attention kernel ------------------------------------------
#
# On CPU, ATen's flash kernel returns the log-sum-exp that SDPA's public API drops, and its backward takes the
# *final* output and log-sum-exp, which is exactly the blockwise backward above. The ring uses it for the SDPA
# backends (fused, flash, auto) when there is no dropout: its dropout masks cannot be replayed block by block.


def fused_blocks_available(device: torch.device, dropout_p: float) -> bool:
    return (
        device.type == "cpu"
        and dropout_p == 0.0
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


def _as_heads(q, k, v, masked):
    """``[b, g, hpg, m, d]`` queries and ``[b, g, 1, l, d]`` keys/values as 4-D heads, the mask as an additive bias."""
    b, groups, per_group, m, d = q.shape
    heads = groups * per_group
    k, v = (t.expand(b, groups, per_group, t.shape[-2], d).reshape(b, heads, t.shape[-2], d) for t in (k, v))
    bias = None
    if masked is not None:
        bias = torch.zeros(masked.squeeze(2).shape, dtype=q.dtype, device=q.device).masked_fill(
            masked.squeeze(2), _NEG_INF
        )
    return q.reshape(b, heads, m, d), k, v, bias


def fused_block_forward(q, k, v, masked, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_forward` (without dropout) through the fused CPU kernel."""
    q4, k4, v4, bias = _as_heads(q, k, v, masked)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, k4, v4, 0.0, False, attn_mask=bias, scale=scale
    )
    lse, out = lse.reshape(q.shape[:-1]), out.reshape(q.shape)
    if masked is not None:
        # A row with every key masked: the kernel reports lse 0; block_forward's -inf and zero output merge right.
        hidden = masked.all(dim=-1)
        lse = lse.masked_fill(hidden, _NEG_INF)
        out = out.masked_fill(hidden.unsqueeze(-1), 0.0)
    return out, lse


def fused_block_backward(q, k, v, masked, scale: float, dout, out, lse):
    """:func:`block_backward` (without dropout) through the fused CPU kernel, from the final ``out`` and ``lse``."""
    q4, k4, v4, bias = _as_heads(q, k, v, masked)
    heads = q4.shape[1]
    lse = _finite_or_zero(lse).reshape(q4.shape[:-1])  # rows with nothing visible: zero gradients, not NaN
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.reshape(q4.shape), q4, k4, v4, out.reshape(q4.shape), lse, 0.0, False, attn_mask=bias, scale=scale
    )
    per_group = heads // k.shape[1]
    grouped = (q.shape[0], k.shape[1], per_group, k.shape[-2], q.shape[-1])
    return dq.reshape(q.shape), dk.reshape(grouped).sum(2, keepdim=True), dv.reshape(grouped).sum(2, keepdim=True)
