"""Requests and what happens to them: status, generated tokens / text / log-probs, and timestamped events.

A server reads a request's ``status``, ``generated_tokens``, ``generated_text``, ``generated_log_probs`` (one per
generated token), ``prompt_log_probs`` (one per prompt token after the first) and ``events`` (ADD_ENGINE,
GENERATED_TOKEN with the token id as payload, FINISH, FAIL with the error message). ``tpot`` holds the seconds
between consecutive tokens and ``ttft`` the seconds from arrival to the first token.
"""

import base64
import copy
import dataclasses
import io
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Dict, List, Optional

import numpy
import torch

from megatron.core.inference.sampling_params import SamplingParams


class Status(Enum):
    WAITING_IN_QUEUE = auto()
    ACTIVE_AND_GENERATING_TOKENS = auto()
    ACTIVE_BUT_NOT_GENERATING_TOKENS = auto()
    COMPLETED = auto()
    FAILED = auto()


@dataclass(kw_only=False)
class InferenceRequest:
    """One prompt and everything generated for it (the static engine's request)."""

    request_id: str
    prompt: str
    sampling_params: Optional[SamplingParams] = None
    inference_parameters: Optional[SamplingParams] = None
    prompt_tokens: Optional[List[int]] = None
    prompt_length: Optional[int] = None
    arrival_time: Optional[float] = None
    status: Optional[Status] = None
    encoder_prompt: Optional[str] = None
    generated_text: Optional[str] = None
    segments: Optional[List[str]] = None
    generated_segments: Optional[List[str]] = None
    generated_sequence_lengths: Optional[List[int]] = None
    generated_tokens: Optional[List[int]] = None
    prompt_log_probs: Optional[List[float]] = None
    generated_log_probs: Optional[List[float]] = None
    prompt_top_n_logprobs: Optional[List[Dict[str, float]]] = None
    generated_top_n_logprobs: Optional[List[Dict[str, float]]] = None
    generated_length: Optional[int] = None
    tpot: List[float] = field(default_factory=list)

    def __post_init__(self):
        # ``inference_parameters`` is Megatron's older name for ``sampling_params``.
        if self.sampling_params is None:
            self.sampling_params = self.inference_parameters
        if self.prompt_tokens is not None and not isinstance(self.prompt_tokens, list):
            self.prompt_tokens = [int(t) for t in self.prompt_tokens]
        if self.prompt_tokens is not None and self.prompt_length is None:
            self.prompt_length = len(self.prompt_tokens)

    def snapshot(self) -> "InferenceRequest":
        """A copy whose growing lists (tokens, log-probs, events) no longer change with this request."""
        copied = copy.copy(self)
        for name in (
            "generated_tokens",
            "generated_log_probs",
            "generated_top_n_logprobs",
            "prompt_log_probs",
            "tpot",
            "events",
        ):
            value = getattr(self, name, None)
            if isinstance(value, list):
                setattr(copied, name, list(value))
        return copied

    def serialize(self) -> dict:
        """A JSON-friendly dict (enums by name, tensors as lists)."""
        out = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, Enum):
                value = value.name
            elif isinstance(value, SamplingParams):
                value = dict(value.__dict__)
            elif isinstance(value, torch.Tensor):
                value = serialize_tensor(value)
            elif isinstance(value, list) and value and isinstance(value[0], DynamicInferenceEvent):
                value = [event.serialize() for event in value]
            out[name] = value
        return out


@dataclass
class VLMInferenceRequest(InferenceRequest):
    """A request with images (vision-language models; no VLM is built here, the request type is Megatron's)."""

    num_img_embeddings_per_tile: int = field(default=None)
    imgs: Any = field(default=None)
    num_tiles: Any = field(default=None)
    decoder_seq_length: int = field(default=None)

    def __post_init__(self):
        super().__post_init__()
        missing = [
            n
            for n in ("num_img_embeddings_per_tile", "imgs", "num_tiles", "decoder_seq_length")
            if getattr(self, n) is None
        ]
        if missing:
            raise ValueError(f"VLMInferenceRequest needs {missing}")


# Megatron lists these VLM fields as required (no default); a dataclass cannot put required fields after
# defaulted ones, so the defaults are removed from the field objects after the class is built (the check in
# __post_init__ above is what enforces them).
for _name in ("num_img_embeddings_per_tile", "imgs", "num_tiles", "decoder_seq_length"):
    VLMInferenceRequest.__dataclass_fields__[_name].default = dataclasses.MISSING


class DynamicInferenceEventType(Enum):
    ADD_ENGINE = auto()
    ADD_CONTEXT = auto()
    GENERATED_TOKEN = auto()
    PAUSE = auto()
    EVICT = auto()
    FINISH = auto()
    FAIL = auto()
    ERROR_TRANSIENT = auto()
    ERROR_NONTRANSIENT = auto()


@dataclass
class DynamicInferenceEvent:
    """Something that happened to a request, when (``time.time()``), with an optional payload (a token id, an
    error message)."""

    timestamp: Optional[float] = None
    type: DynamicInferenceEventType = None
    payload: Any = None

    def __post_init__(self):
        if not isinstance(self.type, DynamicInferenceEventType):
            raise ValueError(f"DynamicInferenceEvent.type must be a DynamicInferenceEventType, got {self.type!r}")
        if self.timestamp is None:
            self.timestamp = time.time()

    def serialize(self) -> dict:
        return {"timestamp": self.timestamp, "type": self.type.name, "payload": self.payload}


DynamicInferenceEvent.__dataclass_fields__["type"].default = dataclasses.MISSING


@dataclass
class DynamicInferenceRequest(InferenceRequest):
    """A request of the dynamic (continuous-batching) engine. ``prompt`` may be None when ``prompt_tokens`` are
    given; ``remaining_prompt_tokens`` are the prompt tokens not yet run through the model (chunked prefill)."""

    request_id: int = None
    prompt: Optional[str] = None
    generated_tokens: List[int] = field(default_factory=list)
    remaining_prompt_tokens: Optional[List[int]] = None
    policy_epoch: Optional[int] = None
    kv_cache_epoch: Optional[int] = None
    latency: Optional[float] = None
    routing_indices: Optional[Any] = None
    finished_chunk_token_count: int = 0
    stop_word_ids: Optional[List[List[int]]] = None
    cg_wait_iters: int = 0
    block_size_tokens: Optional[int] = None
    enable_prefix_caching: bool = False
    num_cached_tokens: int = 0
    precomputed_block_hashes: List[int] = field(default_factory=list)
    ttft: Optional[float] = None
    events: List[DynamicInferenceEvent] = field(default_factory=list)
    event_add_engine: Optional[DynamicInferenceEvent] = None

    def __post_init__(self):
        if self.request_id is None:
            raise ValueError("DynamicInferenceRequest needs a request_id")
        super().__post_init__()
        if self.prompt_tokens is None:
            raise ValueError(f"DynamicInferenceRequest {self.request_id} needs prompt_tokens (tokenize the prompt)")
        if self.remaining_prompt_tokens is None:
            self.remaining_prompt_tokens = list(self.prompt_tokens)
        if self.arrival_time is None:
            self.arrival_time = time.time()
        if self.status is None:
            self.status = Status.WAITING_IN_QUEUE

    def add_event(self, type: DynamicInferenceEventType, payload: Any = None) -> DynamicInferenceEvent:
        event = DynamicInferenceEvent(type=type, payload=payload)
        self.events.append(event)
        if type is DynamicInferenceEventType.ADD_ENGINE:
            self.event_add_engine = event
        return event

    @property
    def finished(self) -> bool:
        return self.status in (Status.COMPLETED, Status.FAILED)


DynamicInferenceRequest.__dataclass_fields__["request_id"].default = dataclasses.MISSING


@dataclass
class DynamicInferenceRequestRecord:
    """The successive requests one logical request became (one, unless it was evicted and re-added)."""

    requests: List[DynamicInferenceRequest] = field(default_factory=list)
    latency: Optional[float] = None

    @classmethod
    def from_request(cls, request: DynamicInferenceRequest) -> "DynamicInferenceRequestRecord":
        return cls(requests=[request])

    def __getitem__(self, index: int) -> DynamicInferenceRequest:
        return self.requests[index]

    def merge(self) -> DynamicInferenceRequest:
        """The request as a whole: the latest one (this engine never splits a request)."""
        return self.requests[-1]


def serialize_tensor(tensor: torch.Tensor) -> List:
    """A tensor as a nested list (JSON-friendly)."""
    return tensor.tolist()


def deserialize_tensor(tensor_as_list: List) -> torch.Tensor:
    return torch.tensor(tensor_as_list)


def serialize_ndarray(arr: numpy.ndarray) -> dict:
    """An array as ``{"dtype", "shape", "data"}`` with the raw bytes base64-encoded (no pickling)."""
    buffer = io.BytesIO()
    numpy.save(buffer, arr, allow_pickle=False)
    return {"__ndarray__": base64.b64encode(buffer.getvalue()).decode("ascii")}


def deserialize_ndarray(obj: dict) -> numpy.ndarray:
    return numpy.load(io.BytesIO(base64.b64decode(obj["__ndarray__"])), allow_pickle=False)


def unwrap_serialized_tensors(serialized_request: dict) -> dict:
    """Turn the serialized arrays inside a serialized request back into arrays (one level deep)."""
    return {
        key: deserialize_ndarray(value) if isinstance(value, dict) and "__ndarray__" in value else value
        for key, value in serialized_request.items()
    }
