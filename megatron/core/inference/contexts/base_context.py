"""What every inference context offers the model: the maximum sequence length (RoPE covers it) and the
attention over cached keys/values that ``Attention.forward`` hands its projected query/key/value to."""

from abc import ABC, abstractmethod

from torch import Tensor


class BaseInferenceContext(ABC):
    """An inference pass's state that outlives one forward: the KV cache and where this forward's tokens go.

    ``Attention.forward(..., inference_context=context)`` projects query/key/value for the new tokens and calls
    :meth:`cached_attention`, which rotates them, stores the keys/values, and attends over everything cached for
    the same sequences. The model code knows nothing else about inference.
    """

    def __init__(self, materialize_only_last_token_logits: bool = True):
        self.materialize_only_last_token_logits = materialize_only_last_token_logits

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
    def _rotate(attention, query: Tensor, key: Tensor, freqs) -> tuple:
        if freqs is None:
            return query, key
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        if isinstance(freqs, tuple):
            raise ValueError("inference with separate query/key rotary embeddings is not supported")
        return apply_rotary_pos_emb(query, freqs, attention.config), apply_rotary_pos_emb(key, freqs, attention.config)
