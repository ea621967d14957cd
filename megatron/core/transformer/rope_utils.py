"""Applying rotary position embeddings (RoPE) to query / key tensors, and the context-parallel split of the angles.

``freqs`` are angles ``[s, 1, 1, rot_dim]`` from :class:`RotaryEmbedding`; only the first ``rot_dim`` channels of
each head are rotated (partial rotary), the rest pass through. Non-interleaved RoPE pairs channel ``i`` with
``i + rot_dim/2``; interleaved RoPE pairs channels ``2i`` and ``2i + 1``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from megatron.core.fusions.fused_rope import fused_apply_rotary_pos_emb, fused_rope_available
from megatron.core.public_api import public_api
from megatron.core.transformer.context_parallel.batch import chunks_of_cp_rank

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


def _rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    if interleaved:
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@public_api("megatron.core.models.common.embeddings.rope_utils")
def apply_rotary_pos_emb_with_cos_sin(t: Tensor, cos: Tensor, sin: Tensor, rotary_interleaved: bool = False) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``t`` by precomputed ``cos`` / ``sin`` (broadcastable to them)."""
    rot_dim = cos.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    rotated = t_rot * cos.to(t.dtype) + _rotate_half(t_rot, rotary_interleaved) * sin.to(t.dtype)
    return torch.cat((rotated, t_pass), dim=-1)


def _positions_within_sequences(cu_seqlens: Tensor) -> Tensor:
    """For packed sequences with boundaries ``cu_seqlens`` ``[n + 1]``, each token's position in its sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


@public_api("megatron.core.models.common.embeddings.rope_utils")
def apply_rotary_pos_emb(
    t: Tensor,
    freqs: Tensor,
    config: TransformerConfig,
    cu_seqlens: Optional[Tensor] = None,
    mscale: float = 1.0,
    cp_group: torch.distributed.ProcessGroup = None,
    mla_rotary_interleaved: bool = False,
):
    """Rotate ``t`` ``[s, b, heads, head_dim]`` by the angles ``freqs`` (``config.rotary_interleaved`` picks the
    channel pairing), with the rotated part scaled by ``mscale`` (YaRN's attention scaling).

    With ``cu_seqlens`` ``t`` holds packed sequences ``[total_tokens, heads, head_dim]`` (THD) and every sequence
    restarts at position 0. ``mla_rotary_interleaved`` says ``t``'s rotary channels are stored interleaved
    (multi-latent attention's layout): they are de-interleaved and then rotated non-interleaved. Context-parallel
    splits of the sequence (``cp_group`` of more than one rank) are not supported yet. With
    ``config.apply_rope_fusion`` the rotation runs through ``megatron.core.fusions.fused_rope`` (our kernel on CUDA).
    """
    if cp_group is not None and cp_group.size() > 1:
        raise ValueError(
            f"not supported yet: context parallelism in apply_rotary_pos_emb (cp_group of {cp_group.size()} ranks)"
        )
    rot_dim = freqs.shape[-1]
    if cu_seqlens is None:
        freqs = freqs[: t.shape[0]]
    else:
        freqs = freqs.reshape(freqs.shape[0], 1, rot_dim)[_positions_within_sequences(cu_seqlens)]
    if mla_rotary_interleaved:
        t_rot = t[..., :rot_dim]
        t = torch.cat((t_rot[..., 0::2], t_rot[..., 1::2], t[..., rot_dim:]), dim=-1)
    interleaved = config.rotary_interleaved and not mla_rotary_interleaved
    cos, sin = torch.cos(freqs) * mscale, torch.sin(freqs) * mscale
    if config.apply_rope_fusion and fused_rope_available(t, interleaved):
        return fused_apply_rotary_pos_emb(t, cos, sin)
    return apply_rotary_pos_emb_with_cos_sin(t, cos, sin, interleaved)


@public_api("megatron.core.models.common.embeddings.rope_utils")
def get_pos_emb_on_this_cp_rank(pos_emb: Tensor, seq_dim: int, cp_group: torch.distributed.ProcessGroup) -> Tensor:
    """This context-parallel rank's share of ``pos_emb`` along ``seq_dim``, in the same load-balanced split as
    ``megatron.core.transformer.context_parallel.batch.get_batch_on_this_cp_rank`` gives the tokens."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    if cp_size == 1:
        return pos_emb
    return chunks_of_cp_rank(pos_emb, seq_dim, cp_size, cp_rank)
