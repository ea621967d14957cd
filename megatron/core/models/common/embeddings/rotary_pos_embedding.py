"""Rotary position embeddings (RoPE; Su et al. 2021) with partial rotation and Llama-3 style frequency scaling,
and multimodal RoPE (M-RoPE, Qwen2-VL) whose channels follow separate temporal / height / width positions."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional

import torch
from torch import Tensor

from megatron.core.transformer.rope_utils import (  # noqa: F401  (Megatron's import path)
    apply_rotary_pos_emb,
    get_pos_emb_on_this_cp_rank,
)
from megatron.core.utils import get_current_device

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.inference.contexts.base_context import BaseInferenceContext


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


def _inverse_frequencies(kv_channels: int, rotary_percent: float, rotary_base: int, device) -> Tensor:
    if not 0.0 < rotary_percent <= 1.0:
        raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
    dim = int(kv_channels * rotary_percent)
    if dim % 2 != 0:
        raise ValueError(f"kv_channels * rotary_percent = {dim} must be even to rotate channel pairs")
    return 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def _repeat_for_pairs(freqs: Tensor, interleaved: bool) -> Tensor:
    """Angles per channel pair -> angles per channel, in the pairing the rotation uses."""
    if interleaved:
        return freqs.repeat_interleave(2, dim=-1)
    return torch.cat((freqs, freqs), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Produces the rotation angles ``[s, 1, 1, rot_dim]`` for positions ``offset .. offset + s - 1``.

    ``rotary_percent`` < 1 rotates only the first ``kv_channels * rotary_percent`` channels of each head. With a
    ``cp_group`` of several ranks, ``forward`` returns this context-parallel rank's share of the angles.
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
        cp_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.cp_group = cp_group
        device = "cpu" if use_cpu_initialization else get_current_device()
        inv_freq = _inverse_frequencies(kv_channels, rotary_percent, rotary_base, device)
        if rope_scaling:
            inv_freq = apply_llama3_scaling(inv_freq, factor=rope_scaling_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> Tensor:
        """One angle per channel pair: ``[s, rot_dim / 2]``."""
        positions = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        return torch.outer(positions, self.inv_freq)

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        """The angle of every rotated channel, ``[s, 1, 1, rot_dim]``, for the whole sequence."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return _repeat_for_pairs(freqs, self.rotary_interleaved)[:, None, None, :]

    def get_cos_sin(self, max_seq_len: int, offset: int = 0) -> (Tensor, Tensor):
        """``cos`` and ``sin`` of :meth:`get_emb`, for ``apply_rotary_pos_emb_with_cos_sin``."""
        emb = self.get_emb(max_seq_len, offset)
        return torch.cos(emb), torch.sin(emb)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> Tensor:
        """:meth:`get_emb`, split over context-parallel ranks unless the sequences are packed (THD), whose
        positions restart per sequence."""
        emb = self.get_emb(max_seq_len, offset)
        if self.cp_group is not None and not packed_seq:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, self.cp_group)
        return emb

    def get_rotary_seq_len(
        self,
        inference_context: BaseInferenceContext,
        transformer: TransformerBlock,
        transformer_input: Tensor,
        transformer_config: TransformerConfig,
        packed_seq_params: Optional[PackedSeqParams] = None,
        *,
        inference_params: Optional[BaseInferenceContext] = None,
    ) -> int:
        """How many positions the angles must cover: an inference context's maximum sequence length; the longest
        packed sequence; else the full sequence attention sees (this stage's input times TP under sequence
        parallelism, times CP)."""
        inference_context = inference_context if inference_context is not None else inference_params
        if inference_context is not None:
            return inference_context.max_sequence_length
        if packed_seq_params is not None:
            return max(packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv)
        hidden = (
            transformer.input_tensor
            if transformer is not None and transformer.input_tensor is not None
            else (transformer_input)
        )
        seq_len = hidden.size(0)
        if transformer_config.sequence_parallel:
            seq_len *= transformer_config.tensor_model_parallel_size
        return seq_len * transformer_config.context_parallel_size


class MultimodalRotaryEmbedding(torch.nn.Module):
    """M-RoPE: the rotated channel pairs are split into sections (``mrope_section``, summing to ``rot_dim / 2``)
    that take their angles from the temporal, height and width position ids in turn."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: int = 10000,
        cp_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.cp_group = cp_group
        self.register_buffer(
            "inv_freq",
            _inverse_frequencies(kv_channels, rotary_percent, rotary_base, get_current_device()),
            persistent=False,
        )

    def forward(
        self,
        position_ids: torch.Tensor,
        mrope_section: List[int],
        cp_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> Tensor:
        """Angles ``[s, b, 1, rot_dim]`` for ``position_ids`` ``[3, b, s]`` (temporal, height, width)."""
        if sum(mrope_section) != self.inv_freq.numel():
            raise ValueError(
                f"mrope_section {mrope_section} must add up to the {self.inv_freq.numel()} rotated channel pairs"
            )
        positions = position_ids.to(self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = positions[..., None] * self.inv_freq  # [3, b, s, rot_dim / 2]
        sections = freqs.split(list(mrope_section), dim=-1)
        freqs = torch.cat([section[i % 3] for i, section in enumerate(sections)], dim=-1)  # [b, s, rot_dim / 2]
        emb = _repeat_for_pairs(freqs, self.rotary_interleaved).transpose(0, 1)[:, :, None, :].contiguous()
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb
