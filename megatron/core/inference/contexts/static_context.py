"""The static context: one contiguous KV cache ``[max_sequence_length, max_batch_size, groups, d]`` per layer,
every sequence of the batch at the same position (Megatron's ``StaticInferenceContext``, formerly
``InferenceParams``)."""

from typing import Dict, Tuple

import torch
from torch import Tensor

from megatron.core.inference.contexts.base_context import BaseInferenceContext
from megatron.core.transformer.enums import AttnMaskType


class StaticInferenceContext(BaseInferenceContext):
    """KV cache for a padded batch that advances one context window at a time.

    A forward over positions ``sequence_len_offset .. sequence_len_offset + s - 1`` of batch rows
    ``batch_size_offset ..`` writes those keys/values and attends over positions ``0 .. end - 1``. The caller
    (the text generation controller) moves ``sequence_len_offset`` on with :meth:`increment_sequence_len_offset`.
    Each layer's cache is allocated on that layer's first forward, in the keys' dtype and device, so a pipeline
    stage only holds its own layers.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        super().__init__(materialize_only_last_token_logits=False)
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"StaticInferenceContext needs max_batch_size >= 1 and max_sequence_length >= 1, got "
                f"{max_batch_size} and {max_sequence_length}"
            )
        self.max_batch_size = max_batch_size
        self._max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: Dict[int, Tuple[Tensor, Tensor]] = {}
        self._rope: tuple = (None, None, None, None)  # (angles, start, end, (cos, sin)) of the last window

    @property
    def max_sequence_length(self) -> int:
        return self._max_sequence_length

    def is_static_batching(self) -> bool:
        return True

    def swap_key_value_dict(self, batch_idx) -> None:
        """Reorder the batch rows of every layer's cache and Mamba states (beam search reorders its beams)."""
        for layer_number, (keys, values) in self.key_value_memory_dict.items():
            self.key_value_memory_dict[layer_number] = (keys[:, batch_idx], values[:, batch_idx])
        for layer_number, (conv, ssm) in self.mamba_states.items():
            rows = slice(0, len(batch_idx))
            conv[rows], ssm[rows] = conv[batch_idx], ssm[batch_idx]

    # ---- Mamba layers: batch row i keeps its states in slot batch_size_offset + i ----

    @property
    def mamba_state_slot_count(self) -> int:
        return self.max_batch_size

    def is_decode_only(self) -> bool:
        """After the first window (the prompts' common prefix) every forward is one new token per row, which a
        Mamba layer applies to its stored states; the first window is a prefill from zero states."""
        return self.sequence_len_offset > 0

    def increment_sequence_len_offset(self, increment: int) -> None:
        self.sequence_len_offset += increment

    def increment_batch_size_offset(self, increment: int) -> None:
        self.batch_size_offset += increment

    def reset_batch_size_offset(self) -> None:
        self.batch_size_offset = 0

    def reset(self) -> None:
        """Start a new batch (the allocated memory is kept and overwritten)."""
        self.sequence_len_offset = 0
        self.batch_size_offset = 0

    def kv_cache_bytes(self) -> int:
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.key_value_memory_dict.values()
        )

    def _layer_cache(self, layer_number: int, key: Tensor) -> Tuple[Tensor, Tensor]:
        cache = self.key_value_memory_dict.get(layer_number)
        if cache is None:
            shape = (self._max_sequence_length, self.max_batch_size) + tuple(key.shape[2:])
            cache = (
                torch.empty(shape, dtype=key.dtype, device=key.device),
                torch.empty(shape, dtype=key.dtype, device=key.device),
            )
            self.key_value_memory_dict[layer_number] = cache
        return cache

    def cached_attention(self, attention, query, key, value, rotary_pos_emb):
        seq, batch = query.shape[:2]
        start, end = self.sequence_len_offset, self.sequence_len_offset + seq
        rows = slice(self.batch_size_offset, self.batch_size_offset + batch)
        if end > self._max_sequence_length or rows.stop > self.max_batch_size:
            raise ValueError(
                f"StaticInferenceContext: positions up to {end} / batch rows up to {rows.stop} exceed "
                f"max_sequence_length={self._max_sequence_length} / max_batch_size={self.max_batch_size}"
            )
        cos_sin = None
        if rotary_pos_emb is not None:
            # The same angles for every layer of this forward: cos/sin once, reused while the window is the same.
            if self._rope[0] is not rotary_pos_emb or self._rope[1:3] != (start, end):
                self._rope = (rotary_pos_emb, start, end, self._cos_sin(rotary_pos_emb[start:end]))
            cos_sin = self._rope[3]
        query, key = self._rotate_cos_sin(attention, query, key, cos_sin)
        key_cache, value_cache = self._layer_cache(attention.layer_number, key)
        key_cache[start:end, rows] = key
        value_cache[start:end, rows] = value
        # One new token attends to everything before it; a window of several attends causally, aligned to the end.
        mask_type = AttnMaskType.no_mask if seq == 1 else AttnMaskType.causal_bottom_right
        return attention.core_attention(
            query,
            key_cache[:end, rows],
            value_cache[:end, rows],
            None,
            attn_mask_type=mask_type,
            attention_bias=None,
            packed_seq_params=None,
        )
