"""Megatron-Core's path for the RoPE helpers, which live in :mod:`megatron.core.transformer.rope_utils` (attention
applies them, so they sit on the transformer's floor)."""

from megatron.core.transformer.rope_utils import (  # noqa: F401
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_with_cos_sin,
    get_pos_emb_on_this_cp_rank,
)
