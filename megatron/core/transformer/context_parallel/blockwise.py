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
