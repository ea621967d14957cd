"""rope_utils (packed sequences, cos/sin form, MLA's interleaved layout, the context-parallel split), the
RotaryEmbedding helpers, M-RoPE, and the GPT spec helpers for multi-token prediction and per-layer specs."""

from types import SimpleNamespace

import torch

from megatron.core.models.common.embeddings.rope_utils import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_with_cos_sin,
    get_pos_emb_on_this_cp_rank,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding, RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec
from megatron.core.transformer.transformer_config import TransformerConfig

PLAIN = SimpleNamespace(rotary_interleaved=False, apply_rope_fusion=False)


def test_packed_sequences_restart_positions():
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    freqs = rope(6)
    a, b = torch.randn(2, 1, 3, 8), torch.randn(4, 1, 3, 8)
    packed = apply_rotary_pos_emb(torch.cat((a, b))[:, 0], freqs, PLAIN, cu_seqlens=torch.tensor([0, 2, 6]))
    separate = torch.cat((apply_rotary_pos_emb(a, freqs, PLAIN), apply_rotary_pos_emb(b, freqs, PLAIN)))[:, 0]
    torch.testing.assert_close(packed, separate)


def test_cos_sin_form_and_helpers_agree():
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=0.5, rotary_base=100)
    t = torch.randn(5, 2, 3, 8)
    cos, sin = rope.get_cos_sin(5)
    torch.testing.assert_close(apply_rotary_pos_emb_with_cos_sin(t, cos, sin), apply_rotary_pos_emb(t, rope(5), PLAIN))
    assert rope.get_freqs_non_repeated(5, offset=1).shape == (5, 2)
    torch.testing.assert_close(rope.get_emb(5, offset=1)[:, 0, 0, :2], rope.get_freqs_non_repeated(5, offset=1))
    # Position p of a length-1 sequence at offset p is the rotation of position p.
    torch.testing.assert_close(rope.get_emb(1, offset=3)[0], rope.get_emb(5)[3])


def test_mla_interleaved_layout_is_deinterleaved_first():
    freqs = RotaryEmbedding(kv_channels=4, rotary_percent=1.0)(3)
    t = torch.randn(3, 1, 1, 4)
    deinterleaved = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    torch.testing.assert_close(
        apply_rotary_pos_emb(t, freqs, PLAIN, mla_rotary_interleaved=True),
        apply_rotary_pos_emb(deinterleaved, freqs, PLAIN),
    )


def test_context_parallel_split_is_load_balanced():
    emb = torch.arange(8).view(8, 1)
    groups = [SimpleNamespace(size=lambda: 2, rank=lambda r=r: r) for r in (0, 1)]
    chunks = [get_pos_emb_on_this_cp_rank(emb, 0, group).flatten().tolist() for group in groups]
    assert chunks == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_rotary_seq_len():
    rope = RotaryEmbedding(kv_channels=4, rotary_percent=1.0)
    config = SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2, context_parallel_size=1)
    hidden = torch.zeros(3, 1, 4)
    assert rope.get_rotary_seq_len(None, SimpleNamespace(input_tensor=None), hidden, config) == 6
    assert rope.get_rotary_seq_len(SimpleNamespace(max_sequence_length=99), None, hidden, config) == 99
    packed = SimpleNamespace(max_seqlen_q=7, max_seqlen_kv=5)
    assert rope.get_rotary_seq_len(None, None, hidden, config, packed) == 7


def test_mrope_with_equal_positions_is_rope():
    mrope = MultimodalRotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    positions = torch.arange(5).view(1, 1, 5).expand(3, 2, 5)
    emb = mrope(positions, mrope_section=[2, 1, 1])
    assert emb.shape == (5, 2, 1, 8)
    torch.testing.assert_close(emb[:, 0], RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(5)[:, 0])
    # Each section follows its own position component: change the width positions only.
    wide = positions.clone()
    wide[2] += 10
    changed = (mrope(wide, [2, 1, 1]) != emb)[0, 0, 0, :4]
    assert changed.tolist() == [False, False, False, True]


def test_gpt_spec_helpers():
    config = TransformerConfig(num_layers=3, hidden_size=8, num_attention_heads=2)
    assert len(get_gpt_decoder_layer_specs(config, False)) == 3
    assert get_gpt_mtp_block_spec(config, None, False) is None
