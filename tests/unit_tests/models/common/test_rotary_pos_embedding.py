"""Rotary embeddings against the rotation they stand for; Llama-3 scaling against its piecewise definition."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    RotaryEmbedding,
    apply_llama3_scaling,
    apply_rotary_pos_emb,
)


def _rotate_pairs_reference(t, position_angles, pairs):
    """Rotate each channel pair (i, j) of t [s, b, n, d] by angle[s, k] for the k-th pair."""
    out = t.clone()
    for k, (i, j) in enumerate(pairs):
        angle = position_angles[:, k].view(-1, 1, 1)
        out[..., i] = t[..., i] * torch.cos(angle) - t[..., j] * torch.sin(angle)
        out[..., j] = t[..., j] * torch.cos(angle) + t[..., i] * torch.sin(angle)
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotation_of_channel_pairs(interleaved, percent):
    d, s, base = 16, 5, 10000
    rot = int(d * percent)
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=percent, rotary_interleaved=interleaved, rotary_base=base)
    freqs = rope(s)
    assert freqs.shape == (s, 1, 1, rot)
    t = torch.randn(s, 2, 3, d, dtype=torch.float64)
    out = apply_rotary_pos_emb(
        t, freqs.double(), SimpleNamespace(rotary_interleaved=interleaved, apply_rope_fusion=False)
    )
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq[None]
    if interleaved:
        pairs = [(2 * k, 2 * k + 1) for k in range(rot // 2)]
    else:
        pairs = [(k, k + rot // 2) for k in range(rot // 2)]
    expected = _rotate_pairs_reference(t, angles, pairs)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[..., rot:], t[..., rot:], rtol=0, atol=0)  # channels past rot pass through


def test_relative_positions_only():
    """q.k after rotation depends only on the distance between positions (the point of RoPE)."""
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    config = SimpleNamespace(rotary_interleaved=False, apply_rope_fusion=False)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    freqs = rope(10)

    def score(i, j):
        return (
            apply_rotary_pos_emb(q, freqs[i : i + 1], config) * apply_rotary_pos_emb(k, freqs[j : j + 1], config)
        ).sum()

    assert torch.allclose(score(2, 5), score(6, 9), atol=1e-5)


def test_offset_and_interpolation():
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    torch.testing.assert_close(rope(4, offset=3), rope(7)[3:])
    halved = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, seq_len_interpolation_factor=2.0)
    torch.testing.assert_close(halved(6)[2], rope(6)[1])


def test_llama3_scaling_piecewise():
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    inv_freq = 1.0 / 500000 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    scaled = apply_llama3_scaling(inv_freq, factor, low, high, original)
    for f, g in zip(inv_freq.tolist(), scaled.tolist()):
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            expected = f  # high frequencies unchanged
        elif wavelen > original / low:
            expected = f / factor  # low frequencies slowed down
        else:
            smooth = (original / wavelen - low) / (high - low)
            expected = (1 - smooth) * f / factor + smooth * f
        assert g == pytest.approx(expected, rel=1e-12)
    assert RotaryEmbedding(128, 1.0, rotary_base=500000, rope_scaling=True).inv_freq.numel() == 64


def test_errors():
    with pytest.raises(ValueError, match=r"rotary_percent must be in \(0, 1\], got 0.0"):
        RotaryEmbedding(kv_channels=8, rotary_percent=0.0)
    with pytest.raises(ValueError, match=r"kv_channels \* rotary_percent = 3 must be even"):
        RotaryEmbedding(kv_channels=6, rotary_percent=0.5)
