"""What every inference context offers the model: the maximum sequence length (RoPE covers it) and the
attention over cached keys/values that ``Attention.forward`` hands its projected query/key/value to."""

from abc import ABC, abstractmethod
from typing import Dict, Tuple

import torch
from torch import Tensor


class BaseInferenceContext(ABC):
    """An inference pass's state that outlives one forward: the KV cache and where this forward's tokens go.

    ``Attention.forward(..., inference_context=context)`` projects query/key/value for the new tokens and calls
    :meth:`cached_attention`, which rotates them, stores the keys/values, and attends over everything cached for
    the same sequences. The model code knows nothing else about inference.
    """

    def __init__(self, materialize_only_last_token_logits: bool = True):
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        # Mamba layers of a hybrid model (this stage's, by local layer number) and their per-slot states.
        self._mamba_mixers: Dict[int, object] = {}
        self.mamba_states: Dict[int, Tuple[Tensor, Tensor]] = {}

    # ---- Mamba layers (see megatron.core.ssm.mamba_inference for the protocol) ----

    def set_mamba_layers(self, mixers: Dict[int, object]) -> None:
        """The model's Mamba mixers by local layer number (``layer_number - pp_layer_offset``); the inference
        wrapper registers them before each forward, so a context built without the model can still hold their
        states."""
        self._mamba_mixers = mixers

    @property
    def mamba_state_slot_count(self) -> int:
        """How many requests' Mamba states the context holds (one slot per batch row or active request)."""
        raise NotImplementedError

    def mamba_states_cache(self, layer_number: int) -> Tuple[Tensor, Tensor]:
        """``(conv_state [slots, ...], ssm_state [slots, ...])`` of a Mamba layer, allocated zeroed on the layer's
        first forward with the mixer's own shapes, device and dtypes (``MambaMixer.allocate_inference_cache``)."""
        states = self.mamba_states.get(layer_number)
        if states is None:
            mixer = self._mamba_mixers.get(layer_number)
            if mixer is None:
                raise ValueError(
                    f"{type(self).__name__}: Mamba layer {layer_number} asked for its states but no Mamba layers "
                    "were registered; run the model through an inference wrapper (GPTInferenceWrapper), which "
                    "registers them, or call set_mamba_layers()"
                )
            states = mixer.allocate_inference_cache(self.mamba_state_slot_count, self.max_sequence_length)
            self.mamba_states[layer_number] = states
        return states

    def mamba_states_bytes(self) -> int:
        return sum(c.numel() * c.element_size() + s.numel() * s.element_size() for c, s in self.mamba_states.values())

    @abstractmethod
    def is_static_batching(self) -> bool:
        """True for the static (padded, one position for all sequences) context."""

    def is_dynamic_batching(self) -> bool:
        return not self.is_static_batching()

    @property
    @abstractmethod
    def max_sequence_length(self) -> int:
        """The longest sequence (prompt + generated) the cache holds."""

    @abstractmethod
    def cached_attention(self, attention, query: Tensor, key: Tensor, value: Tensor, rotary_pos_emb) -> Tensor:
        """Attention of ``attention`` (a self-attention module) for this forward's tokens over the cache.

        ``query`` ``[s, b, heads, d]``, ``key``/``value`` ``[s, b, groups, d]`` (this rank's heads), not yet
        rotated; ``rotary_pos_emb`` the angles for positions ``0 .. max_sequence_length - 1`` or None. Returns
        the core-attention output ``[s, b, heads * d]``.
        """

    @staticmethod
    def _cos_sin(freqs) -> tuple:
        """cos/sin of rotary angles, to rotate every layer's query/key of a forward with (``_rotate_cos_sin``)."""
        if isinstance(freqs, tuple):
            raise ValueError("inference with separate query/key rotary embeddings is not supported")
        return torch.cos(freqs), torch.sin(freqs)

    @staticmethod
    def _rotate_cos_sin(attention, query: Tensor, key: Tensor, cos_sin) -> tuple:
        """``apply_rotary_pos_emb`` of query and key, from the angles' cos/sin computed once per forward (None: no
        rotary embedding)."""
        if cos_sin is None:
            return query, key
        from megatron.core.transformer.rope_utils import apply_rotary_pos_emb_with_cos_sin

        cos, sin = cos_sin
        interleaved = attention.config.rotary_interleaved
        return (
            apply_rotary_pos_emb_with_cos_sin(query, cos, sin, interleaved),
            apply_rotary_pos_emb_with_cos_sin(key, cos, sin, interleaved),
        )
