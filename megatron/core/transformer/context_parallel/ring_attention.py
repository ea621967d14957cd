"""Ring attention ("p2p"): queries stay put, key/value blocks travel around the context-parallel ring.

Each of the ``R`` ranks of the ring holds its queries and one block of keys and values. In step ``t`` a rank attends
to the block that started ``t`` ranks before it, while the next block is already in flight (one batched
``isend``/``irecv`` pair per step); the partial results merge by log-sum-exp (:mod:`.blockwise`), so after ``R`` steps
every rank has exact attention over the whole sequence. The backward sends the blocks around again, together with
their key/value gradients: a block's ``dk``/``dv`` accumulates as it visits every rank and arrives back at its owner
after the last step. Per rank and direction that is ``R - 1`` key/value transfers forward, ``R - 1`` in backward plus
``R`` gradient transfers, each ``2 x (s / R) x b x n_kv x d`` elements.

Which query chunk may see which key chunk is decided per *chunk* of the global sequence (:class:`RingLayout`): with
a causal mask a query chunk sees earlier chunks fully, its own chunk causally, and later chunks not at all, and
skipped pairs cost nothing. Under the load-balanced split (rank ``r`` holds chunks ``r`` and ``2R-1-r``) that makes
every step after the first half of a block on every rank: either all queries against the first half of the keys,
or the second half of the queries against all keys, which is the balance Megatron's zigzag layout is for.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.random import get_device_rng_state, set_device_rng_state
from megatron.core.transformer.context_parallel.blockwise import (
    block_backward,
    block_forward,
    fused_block_backward,
    fused_block_forward,
    fused_blocks_available,
    merge_into,
)

Index = Union[slice, torch.Tensor]


@dataclass(frozen=True)
class RingLayout:
    """Where the chunks of the global sequence live on a ring.

    ``q_chunks``: the global chunk ids of this rank's queries, in the order they are stored. ``kv_chunks[j]``: the
    chunk ids of the keys/values ring rank ``j`` holds, in stored order. Every chunk is ``chunk_len`` tokens.
    """

    group: dist.ProcessGroup
    q_chunks: Tuple[int, ...]
    kv_chunks: Tuple[Tuple[int, ...], ...]
    chunk_len: int
    causal: bool


def _token_index(positions: Sequence[int], chunk_len: int, device) -> Index:
    """Tokens of the stored chunks at ``positions``: a slice when they are adjacent, else an index tensor."""
    if all(b == a + 1 for a, b in zip(positions, positions[1:])):
        return slice(positions[0] * chunk_len, (positions[-1] + 1) * chunk_len)
    return torch.cat([torch.arange(p * chunk_len, (p + 1) * chunk_len, device=device) for p in positions])


@dataclass
class _BlockPlan:
    """One query chunk against the visible part of one key/value block."""

    q_rows: slice
    kv_index: Index
    mask_cols: torch.Tensor  # global key positions of the selected keys, for the caller's attention mask
    causal_part: Optional[torch.Tensor]  # [m, l] True where the diagonal chunk hides a later key


def _plans(layout: RingLayout, source: int, device) -> List[_BlockPlan]:
    c = layout.chunk_len
    plans = []
    kv_ids = layout.kv_chunks[source]
    for q_pos, q_id in enumerate(layout.q_chunks):
        visible = [p for p, k_id in enumerate(kv_ids) if not layout.causal or k_id <= q_id]
        if not visible:
            continue  # a fully masked pair: no compute, no memory
        visible_ids = [kv_ids[p] for p in visible]
        causal_part = None
        if layout.causal and q_id in visible_ids:
            hidden = torch.zeros(c, c * len(visible), dtype=torch.bool, device=device)
            at = visible_ids.index(q_id) * c
            hidden[:, at : at + c] = torch.ones(c, c, dtype=torch.bool, device=device).triu(1)
            causal_part = hidden
        mask_cols = torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in visible_ids])
        plans.append(
            _BlockPlan(slice(q_pos * c, (q_pos + 1) * c), _token_index(visible, c, device), mask_cols, causal_part)
        )
    return plans


def _block_mask(plan: _BlockPlan, attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The block's mask ``[*, 1, 1, m, l]`` (True = masked): the diagonal's causal part and the caller's mask."""
    masked = None
    if attention_mask is not None:
        masked = attention_mask[:, :, plan.q_rows].index_select(-1, plan.mask_cols)
    if plan.causal_part is not None:
        masked = plan.causal_part if masked is None else masked | plan.causal_part
    if masked is None:
        return None
    while masked.dim() < 4:
        masked = masked.unsqueeze(0)
    return masked.unsqueeze(2)


def _select(tensor: torch.Tensor, index: Index) -> torch.Tensor:
    return tensor[..., index, :] if isinstance(index, slice) else tensor.index_select(-2, index)


def _add_at(target: torch.Tensor, index: Index, value: torch.Tensor) -> None:
    if isinstance(index, slice):
        target[..., index, :] += value
    else:
        target.index_add_(-2, index, value)


class _Ring:
    """The ring's neighbours and one step of it: send ours to the next rank, receive the previous rank's."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: torch.Tensor) -> Tuple[torch.Tensor, list]:
        received = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(requests: list) -> None:
        for request in requests:
            request.wait()


class RingAttentionFunction(torch.autograd.Function):
    """Exact attention of this rank's queries over the ring's keys and values (fp32 in, fp32 out).

    ``q`` ``[b, groups, heads_per_group, sq, d]``; ``k``, ``v`` ``[b, groups, 1, sk, d]``; ``attention_mask``
    ``[b | 1, 1, sq, s]`` over the *global* key positions (True = masked), or None.
    """

    @staticmethod
    def forward(ctx, q, k, v, attention_mask, layout: RingLayout, scale: float, dropout_p: float, fused: bool):
        ring = _Ring(layout.group)
        fused = fused and fused_blocks_available(q.device, dropout_p)
        rng_state = get_device_rng_state() if dropout_p > 0.0 else None
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack((k, v))
        plans = {}
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, requests = ring.start(kv)
            source = (ring.rank - step) % ring.size
            plans[source] = _plans(layout, source, q.device)
            for plan in plans[source]:
                block = (
                    q[..., plan.q_rows, :],
                    _select(kv[0], plan.kv_index),
                    _select(kv[1], plan.kv_index),
                    _block_mask(plan, attention_mask),
                    scale,
                )
                block_out, block_lse = fused_block_forward(*block) if fused else block_forward(*block, dropout_p)
                merge_into(out[..., plan.q_rows, :], lse[..., plan.q_rows], block_out, block_lse)
            if step + 1 < ring.size:
                ring.finish(requests)
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse, attention_mask)
        ctx.plans, ctx.group, ctx.scale, ctx.dropout_p, ctx.rng_state = plans, layout.group, scale, dropout_p, rng_state
        ctx.fused = fused
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, attention_mask = ctx.saved_tensors
        ring = _Ring(ctx.group)
        if ctx.rng_state is not None:  # replay the forward's dropout masks, then leave the generator as it was
            live_state = get_device_rng_state()
            set_device_rng_state(ctx.rng_state)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack((k, v))
        dkv_received, dkv_requests = None, None
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, kv_requests = ring.start(kv)
            source = (ring.rank - step) % ring.size
            dkv = torch.zeros_like(kv)
            for plan in ctx.plans[source]:
                block = (
                    q[..., plan.q_rows, :],
                    _select(kv[0], plan.kv_index),
                    _select(kv[1], plan.kv_index),
                    _block_mask(plan, attention_mask),
                    ctx.scale,
                )
                rows = plan.q_rows
                if ctx.fused:
                    block_grads = fused_block_backward(*block, dout[..., rows, :], out[..., rows, :], lse[..., rows])
                else:
                    block_grads = block_backward(
                        *block, ctx.dropout_p, dout[..., rows, :], lse[..., rows], delta[..., rows]
                    )
                block_dq, block_dk, block_dv = block_grads
                dq[..., plan.q_rows, :] += block_dq
                _add_at(dkv[0], plan.kv_index, block_dk)
                _add_at(dkv[1], plan.kv_index, block_dv)
            if dkv_requests is not None:
                # The block's gradient so far arrived from the previous rank while this step computed.
                ring.finish(dkv_requests)
                dkv += dkv_received
            if ring.size > 1:
                dkv_received, dkv_requests = ring.start(dkv)
            if step + 1 < ring.size:
                ring.finish(kv_requests)
                kv = next_kv
        if ring.size > 1:
            ring.finish(dkv_requests)  # after the last step each block's gradient is back with its owner
            dkv = dkv_received
        if ctx.rng_state is not None:
            set_device_rng_state(live_state)
        return dq, dkv[0], dkv[1], None, None, None, None, None


def ring_attention(
    q, k, v, attention_mask, layout: RingLayout, scale: float, dropout_p: float, fused: bool = False
) -> torch.Tensor:
    """:class:`RingAttentionFunction` (see there for shapes). ``fused``: compute blocks with PyTorch's fused CPU
    flash kernel where it applies (CPU, no dropout; :func:`.blockwise.fused_blocks_available`), else explicitly."""
    return RingAttentionFunction.apply(q, k, v, attention_mask, layout, scale, dropout_p, fused)
