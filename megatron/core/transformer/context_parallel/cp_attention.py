"""Core attention over a sequence sharded across the context-parallel group, in four ways (``cp_comm_type``).

Every CP rank holds the load-balanced part of the sequence that :func:`.batch.get_batch_on_this_cp_rank` gave it:
with ``C`` ranks the sequence is cut into ``2C`` chunks and rank ``r`` holds chunks ``r`` and ``2C-1-r``
(concatenated, in that order). Queries, keys and values arrive as ``[s/C, b, heads, d]``; the output is this rank's
``[s/C, b, heads * d]`` of exact attention over the *whole* sequence:

- ``p2p``: ring attention (:mod:`.ring_attention`); keys/values travel, memory per rank stays ``O(s/C)``.
- ``all_gather``: gather the keys and values of the whole sequence, attend with the local queries. Simple, one
  collective, ``O(s)`` key/value memory per rank.
- ``a2a``: Ulysses (Jacobs et al. 2023): an all-to-all trades the sequence split for a head split, each rank
  attends over the whole sequence for ``heads / C`` heads, a second all-to-all trades back. Needs heads
  (and key/value heads) divisible by ``C``.
- ``a2a+p2p``: hierarchical: all-to-all inside groups of ``hierarchical_context_parallel_sizes[0]`` consecutive CP
  ranks, ring attention across the ``[1]`` groups.

An ``attention_mask`` (True = masked) is this rank's query rows over all keys, ``[b | 1, 1, s/C, s]`` in global key
order, as the CP split of a ``[b, 1, s, s]`` mask is. Causal mask types are applied by global position. Attention
dropout draws from the tensor-parallel RNG stream, as in the local attention.

Attention backends (``attention_backend``): ``all_gather`` and ``a2a`` attend with the layer's backend (the explicit
reference for ``unfused`` / ``local``, SDPA otherwise; CP refuses sliding windows, the one case for the Triton
kernel). The ring (``p2p``, and the ring part of ``a2a+p2p``) merges blocks by their log-sum-exp, which SDPA's
public API does not return: on CPU without dropout the SDPA backends compute blocks with ATen's fused CPU flash
kernel (which does), everything else with the explicit fp32 math of :mod:`.blockwise`.
"""

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import all_to_all, gather_from_sequence_parallel_region
from megatron.core.transformer.context_parallel.batch import zigzag_chunk_ids
from megatron.core.transformer.context_parallel.ring_attention import RingLayout, ring_attention
from megatron.core.fusions.fused_flash_attention import attention_reference
from megatron.core.transformer.enums import CP_COMM_TYPES, AttnBackend, AttnMaskType

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


def _token_order(chunk_ids: Sequence[int], chunk_len: int, device) -> torch.Tensor:
    """Global positions of the tokens stored as ``chunk_ids`` chunks one after another."""
    return torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len, device=device) for c in chunk_ids])


def _rank_concat_order(ranks: Sequence[int], cp_size: int, chunk_len: int, device) -> torch.Tensor:
    """Global positions of the tokens of CP ``ranks``' parts concatenated in that order."""
    ids = [chunk for rank in ranks for chunk in zigzag_chunk_ids(cp_size, rank)]
    return _token_order(ids, chunk_len, device)


def _gather_rows(mask: torch.Tensor, group) -> torch.Tensor:
    """All-gather a mask's query rows (dim 2) over ``group``, in group-rank order (masks carry no gradient)."""
    pieces = [torch.empty_like(mask) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, mask.contiguous(), group=group)
    return torch.cat(pieces, dim=2)


def _scatter_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[s_local, b, n, d]`` -> ``[size * s_local, b, n / size, d]``: this rank's heads for every rank's tokens,
    in group-rank order."""
    size = dist.get_world_size(group)
    s, b, n, d = x.shape
    x = x.reshape(s, b, size, n // size, d).permute(2, 0, 1, 3, 4).reshape(size * s, b, n // size, d)
    return all_to_all(group, x)


def _gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_scatter_heads`."""
    size = dist.get_world_size(group)
    x = all_to_all(group, x)
    s_total, b, n_part, d = x.shape
    s = s_total // size
    return x.reshape(size, s, b, n_part, d).permute(1, 2, 0, 3, 4).reshape(s, b, size * n_part, d)


class ContextParallelAttention:
    """Exact attention for a CP-sharded sequence; :class:`DotProductAttention` hands its work here when
    ``context_parallel_size > 1``.

    ``cp_group``: the context-parallel group; ``hierarchical_groups``: ``[a2a group, p2p group]`` for ``a2a+p2p``.
    """

    def __init__(
        self,
        cp_comm_type: str,
        cp_group,
        attn_mask_type: AttnMaskType,
        softmax_scale: float,
        num_heads: int,
        num_query_groups: int,
        hierarchical_groups: Optional[List] = None,
        attention_backend: AttnBackend = AttnBackend.auto,
    ):
        if cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={cp_comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}")
        self.cp_comm_type = cp_comm_type
        self.cp_group = cp_group
        self.cp_size = dist.get_world_size(cp_group)
        self.cp_rank = dist.get_rank(cp_group)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.attention_backend = attention_backend
        a2a_size = {"a2a": self.cp_size, "a2a+p2p": None}.get(cp_comm_type, 1)
        if cp_comm_type == "a2a+p2p":
            if not hierarchical_groups or len(hierarchical_groups) != 2:
                raise ValueError(
                    "cp_comm_type='a2a+p2p' needs hierarchical_context_parallel_sizes=[a2a size, p2p size] "
                    "(and parallel_state's hierarchical context-parallel groups built from it)"
                )
            self.a2a_group, self.p2p_group = hierarchical_groups
            a2a_size = dist.get_world_size(self.a2a_group)
        for what, count in (("num_attention_heads", num_heads), ("num_query_groups", num_query_groups)):
            if count % a2a_size != 0:
                raise ValueError(
                    f"cp_comm_type={cp_comm_type!r} splits heads over {a2a_size} context-parallel ranks, but this "
                    f"tensor-parallel rank has {count} {what}; use a head count divisible by it or cp_comm_type='p2p'"
                )

    # ---- shapes -------------------------------------------------------------------------------------------------

    def __call__(self, query, key, value, attention_mask, attn_mask_type, dropout_p: float, sequence_parallel: bool):
        """``[s/C, b, heads, d]`` query, ``[s/C, b, groups, d]`` key/value -> ``[s/C, b, heads * d]``."""
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type in _CAUSAL_TYPES
        s_local, b, heads, d = query.shape
        if s_local % 2 != 0:
            raise ValueError(
                f"context parallelism needs an even number of tokens per CP rank (got {s_local}); use a sequence "
                f"length divisible by 2 x context_parallel_size = {2 * self.cp_size}"
            )
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask must be a bool tensor (True = masked), got {attention_mask.dtype}")
            expected = (s_local, s_local * self.cp_size)
            if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or tuple(attention_mask.shape[2:]) != expected:
                raise ValueError(
                    f"under context parallelism attention_mask must be this rank's query rows over all keys, "
                    f"[b or 1, 1, {expected[0]}, {expected[1]}] (the get_batch_on_this_cp_rank split of a "
                    f"[b, 1, s, s] mask); got {tuple(attention_mask.shape)}"
                )
        if dropout_p > 0.0 and not sequence_parallel:
            # Heads are split over TP ranks, so each draws its own masks (under SP the layer already runs forked).
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._attend(query, key, value, attention_mask, causal, dropout_p)
        else:
            context = self._attend(query, key, value, attention_mask, causal, dropout_p)
        return context.reshape(s_local, b, heads * d).to(query.dtype)

    def _attend(self, query, key, value, attention_mask, causal, dropout_p):
        if self.cp_comm_type == "p2p":
            layout = RingLayout(
                group=self.cp_group,
                q_chunks=zigzag_chunk_ids(self.cp_size, self.cp_rank),
                kv_chunks=tuple(zigzag_chunk_ids(self.cp_size, r) for r in range(self.cp_size)),
                chunk_len=query.shape[0] // 2,
                causal=causal,
            )
            return self._ring(query, key, value, attention_mask, layout, dropout_p)
        if self.cp_comm_type == "all_gather":
            return self._all_gather(query, key, value, attention_mask, causal, dropout_p)
        if self.cp_comm_type == "a2a":
            return self._ulysses(query, key, value, attention_mask, causal, dropout_p)
        return self._hierarchical(query, key, value, attention_mask, causal, dropout_p)

    def _ring(self, query, key, value, attention_mask, layout: RingLayout, dropout_p):
        """``[s, b, n, d]`` in, ``[s, b, n, d]`` out, through :func:`ring_attention`'s grouped layout."""
        s, b, heads, d = query.shape
        groups = key.shape[2]
        q = query.float().permute(1, 2, 0, 3).reshape(b, groups, heads // groups, s, d)
        k, v = (t.float().permute(1, 2, 0, 3).unsqueeze(2) for t in (key, value))
        fused = self.attention_backend not in (AttnBackend.unfused, AttnBackend.local)
        out = ring_attention(q, k, v, attention_mask, layout, self.softmax_scale, dropout_p, fused)
        return out.reshape(b, heads, s, d).permute(2, 0, 1, 3)

    # ---- all_gather -----------------------------------------------------------------------------------------------

    def _all_gather(self, query, key, value, attention_mask, causal, dropout_p):
        s_local = query.shape[0]
        chunk = s_local // 2
        device = query.device
        # Gathered in rank order; index_select puts the keys back in sequence order (its backward scatters back).
        natural = torch.argsort(_rank_concat_order(range(self.cp_size), self.cp_size, chunk, device))
        key, value = (
            gather_from_sequence_parallel_region(t, True, group=self.cp_group).index_select(0, natural)
            for t in (key, value)
        )
        q_pos = _token_order(zigzag_chunk_ids(self.cp_size, self.cp_rank), chunk, device)
        k_pos = torch.arange(key.shape[0], device=device)
        return self._sdpa(query, key, value, attention_mask, causal, q_pos, k_pos, dropout_p)

    # ---- a2a (Ulysses) --------------------------------------------------------------------------------------------

    def _ulysses(self, query, key, value, attention_mask, causal, dropout_p):
        chunk = query.shape[0] // 2
        device = query.device
        order = _rank_concat_order(range(self.cp_size), self.cp_size, chunk, device)
        natural = torch.argsort(order)
        q, k, v = (_scatter_heads(t, self.cp_group).index_select(0, natural) for t in (query, key, value))
        if attention_mask is not None:
            attention_mask = _gather_rows(attention_mask, self.cp_group).index_select(2, natural)
        positions = torch.arange(q.shape[0], device=device)
        context = self._sdpa(q, k, v, attention_mask, causal, positions, positions, dropout_p)
        return _gather_heads(context.index_select(0, order), self.cp_group)

    # ---- a2a+p2p --------------------------------------------------------------------------------------------------

    def _hierarchical(self, query, key, value, attention_mask, causal, dropout_p):
        a2a_size = dist.get_world_size(self.a2a_group)
        p2p_size = dist.get_world_size(self.p2p_group)
        p2p_rank = dist.get_rank(self.p2p_group)

        def chunks_of(ring_rank):  # the a2a group at ring position ring_rank holds its CP ranks' parts in order
            return tuple(
                chunk for i in range(a2a_size) for chunk in zigzag_chunk_ids(self.cp_size, ring_rank * a2a_size + i)
            )

        q, k, v = (_scatter_heads(t, self.a2a_group) for t in (query, key, value))
        if attention_mask is not None:
            attention_mask = _gather_rows(attention_mask, self.a2a_group)
        layout = RingLayout(
            group=self.p2p_group,
            q_chunks=chunks_of(p2p_rank),
            kv_chunks=tuple(chunks_of(r) for r in range(p2p_size)),
            chunk_len=query.shape[0] // 2,
            causal=causal,
        )
        context = self._ring(q, k, v, attention_mask, layout, dropout_p)
        return _gather_heads(context, self.a2a_group)

    # ---- local attention once the keys are in place ---------------------------------------------------------------

    def _sdpa(self, query, key, value, attention_mask, causal, q_pos, k_pos, dropout_p):
        """``[sq, b, n, d]`` queries at global positions ``q_pos`` over ``[sk, b, groups, d]`` keys at ``k_pos``."""
        heads, groups = query.shape[2], key.shape[2]
        if heads != groups:
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        q, k, v = (t.float().permute(1, 2, 0, 3) for t in (query, key, value))
        masked = None
        if causal:
            masked = (k_pos[None, :] > q_pos[:, None])[None, None]
        if attention_mask is not None:
            masked = attention_mask if masked is None else masked | attention_mask
        if self.attention_backend in (AttnBackend.unfused, AttnBackend.local):
            context = attention_reference(q, k, v, self.softmax_scale, masked, dropout_p=dropout_p)
        else:  # CP refuses sliding windows, so every other backend is SDPA here
            keep = None if masked is None else ~masked
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=self.softmax_scale
            )
        return context.permute(2, 0, 1, 3)
