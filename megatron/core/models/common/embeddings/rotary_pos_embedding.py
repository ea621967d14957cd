"""Rotary position embeddings (RoPE; Su et al. 2021) with partial rotation and Llama-3 style frequency scaling."""

import math
from typing import Optional

import torch

from megatron.core.utils import get_current_device


def apply_llama3_scaling(
    inv_freq: torch.Tensor,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: keep high frequencies, divide low ones by ``factor``, blend smoothly between."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Produces the rotation angles ``[s, 1, 1, rot_dim]`` for positions ``offset .. offset + s - 1``.

    ``rotary_percent`` < 1 rotates only the first ``kv_channels * rotary_percent`` channels of each head.
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
    ):
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
        dim = int(kv_channels * rotary_percent)
        if dim % 2 != 0:
            raise ValueError(f"kv_channels * rotary_percent = {dim} must be even to rotate channel pairs")
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        device = "cpu" if use_cpu_initialization else get_current_device()
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        if rope_scaling:
            inv_freq = apply_llama3_scaling(inv_freq, factor=rope_scaling_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        positions = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = torch.outer(positions, self.inv_freq)
        if self.rotary_interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    def get_rotary_seq_len(self, transformer_input: torch.Tensor, config) -> int:
        """Full sequence length seen by attention (the local length times TP under sequence parallelism)."""
        seq_len = transformer_input.size(0)
        if config.sequence_parallel:
            seq_len *= config.tensor_model_parallel_size
        return seq_len


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None, mscale: float = 1.0):
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` ``[s, b, heads, head_dim]``; pass the rest through."""
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens (packed THD sequences) is not supported by apply_rotary_pos_emb")
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    freqs = freqs[: t.shape[0]]
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    rotated = t_rot * cos + _rotate_half(t_rot, config.rotary_interleaved) * sin
    return torch.cat((rotated, t_pass), dim=-1)
