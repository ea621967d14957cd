"""How to sample one request's tokens and when to stop (Megatron-Core's ``SamplingParams``)."""

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class SamplingParams:
    """Sampling and stopping rules of a request.

    Greedy decoding is ``top_k=1`` (Megatron's convention) or ``temperature=0``. ``top_k=0`` and ``top_p=0.0`` turn
    those filters off. Generation stops at ``termination_id`` (the tokenizer's end-of-document id when None), at
    any of ``stop_words`` (strings; the stop string is cut from the text unless ``detokenize_stop_sequence``), or
    after ``num_tokens_to_generate`` new tokens (``num_tokens_total``: prompt plus new tokens), whichever is first.

    ``seed`` (not in Megatron's class, which seeds only per engine) makes this request's samples reproducible and
    independent of which other requests share its batch; None draws from the engine's generator.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    return_log_probs: bool = False
    skip_prompt_log_probs: bool = False
    return_segments: bool = False
    num_tokens_to_generate: Optional[int] = None
    num_tokens_total: Optional[int] = None
    termination_id: Optional[int] = None
    top_n_logprobs: int = 0
    return_prompt_top_n_logprobs: bool = False
    add_BOS: bool = False
    stop_words: Optional[List[str]] = None
    detokenize_stop_sequence: bool = False
    return_prompt_tokens: bool = False
    seed: Optional[int] = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise one ValueError naming the first bad field (called on construction and before a request joins)."""
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in [0, 1] (0 = off), got {self.top_p}")
        if self.num_tokens_to_generate is not None and self.num_tokens_to_generate < 0:
            raise ValueError(f"SamplingParams.num_tokens_to_generate must be >= 0, got {self.num_tokens_to_generate}")
        if self.num_tokens_total is not None and self.num_tokens_total < 1:
            raise ValueError(f"SamplingParams.num_tokens_total must be >= 1, got {self.num_tokens_total}")
        if self.top_n_logprobs < 0:
            raise ValueError(f"SamplingParams.top_n_logprobs must be >= 0, got {self.top_n_logprobs}")
        if self.stop_words is not None and (
            isinstance(self.stop_words, str) or not all(isinstance(w, str) and w for w in self.stop_words)
        ):
            raise ValueError(f"SamplingParams.stop_words must be a list of non-empty strings, got {self.stop_words!r}")

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0.0

    def add_attributes(self, attribute_value_pair: dict) -> None:
        """Set several fields at once (Megatron's helper), validating the result."""
        for key, value in attribute_value_pair.items():
            if not hasattr(self, key):
                raise ValueError(f"SamplingParams has no field {key!r}")
            setattr(self, key, value)
        self.validate()

    def max_new_tokens(self, prompt_length: int, max_sequence_length: int) -> int:
        """How many tokens the request may generate: the explicit limits, capped by the context length."""
        limit = max_sequence_length - prompt_length
        if self.num_tokens_to_generate is not None:
            limit = min(limit, self.num_tokens_to_generate)
        if self.num_tokens_total is not None:
            limit = min(limit, self.num_tokens_total - prompt_length)
        return limit
