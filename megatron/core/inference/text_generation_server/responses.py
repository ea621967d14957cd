"""OpenAI's response shapes for completions and chat completions: whole responses and streamed chunks.

Field for field what OpenAI's API sends (``id``, ``object``, ``created``, ``model``, ``choices``, ``usage``;
chunks as ``text_completion`` / ``chat.completion.chunk`` objects), so the ``openai`` client parses them into its
own types. Log-probs come in each endpoint's own form: the legacy ``{tokens, token_logprobs, top_logprobs,
text_offset}`` for completions and ``{content: [{token, logprob, bytes, top_logprobs}]}`` for chat.
"""

import json
import time
import uuid
from typing import Dict, List, Optional

from megatron.core.inference.text_generation_server.generation import ChoiceUpdate


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(payload) -> str:
    """One server-sent event as OpenAI writes it: ``data: <json>`` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChoiceAccumulator:
    """The pieces of one choice gathered into its final text, tokens and log-probs (non-streaming responses)."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.tokens: List[int] = []
        self.log_probs: List[float] = []
        self.top_logprobs: List[Dict[str, float]] = []
        self.finish_reason: Optional[str] = None

    def add(self, update: ChoiceUpdate) -> None:
        self.text += update.text
        self.tokens += update.tokens
        self.log_probs += update.log_probs
        self.top_logprobs += update.top_logprobs
        if update.finish_reason is not None:
            self.finish_reason = update.finish_reason


# ------------------------------------------------------------------------ completions


def completion_logprobs(
    tokenizer,
    tokens: List[int],
    log_probs: List[Optional[float]],
    top_logprobs: List[Optional[Dict[str, float]]],
    top_n: int,
    text_offset: int = 0,
) -> dict:
    """The completions endpoint's log-probs object (``top_logprobs`` entries hold ``top_n`` alternatives)."""
    strings = [tokenizer.detokenize([t]) for t in tokens]
    offsets, position = [], text_offset
    for piece in strings:
        offsets.append(position)
        position += len(piece)
    tops = None
    if top_n > 0:
        tops = [None if top is None else dict(list(top.items())[:top_n]) for top in _padded(top_logprobs, tokens)]
    return {"tokens": strings, "token_logprobs": list(log_probs), "top_logprobs": tops, "text_offset": offsets}


def _padded(items: List, tokens: List) -> List:
    return list(items) + [None] * (len(tokens) - len(items))


def completion_choice(index: int, text: str, finish_reason: Optional[str], logprobs: Optional[dict]) -> dict:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(
    response_id: str, created: int, model: str, choices: List[dict], usage_counts: Dict[str, int]
) -> dict:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_counts,
        "system_fingerprint": None,
    }


def completion_chunk(
    response_id: str,
    created: int,
    model: str,
    choices: List[dict],
    usage_counts: Optional[Dict[str, int]] = None,
    include_usage: bool = False,
) -> dict:
    chunk = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if include_usage:
        chunk["usage"] = usage_counts
    return chunk


# ------------------------------------------------------------------------ chat


def chat_logprobs(
    tokenizer, tokens: List[int], log_probs: List[float], top_logprobs: List[Dict[str, float]], top_n: int
) -> dict:
    content = []
    for token, log_prob, top in zip(tokens, log_probs, _padded(top_logprobs, tokens)):
        text = tokenizer.detokenize([token])
        alternatives = (
            []
            if top is None or top_n == 0
            else [
                {"token": alt, "logprob": float(lp), "bytes": list(alt.encode("utf-8"))}
                for alt, lp in list(top.items())[:top_n]
            ]
        )
        content.append(
            {
                "token": text,
                "logprob": float(log_prob),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": alternatives,
            }
        )
    return {"content": content, "refusal": None}


def chat_choice(index: int, text: str, finish_reason: Optional[str], logprobs: Optional[dict]) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "refusal": None},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_response(
    response_id: str, created: int, model: str, choices: List[dict], usage_counts: Dict[str, int]
) -> dict:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_counts,
        "system_fingerprint": None,
    }


def chat_chunk(
    response_id: str,
    created: int,
    model: str,
    choices: List[dict],
    usage_counts: Optional[Dict[str, int]] = None,
    include_usage: bool = False,
) -> dict:
    chunk = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if include_usage:
        chunk["usage"] = usage_counts
    return chunk


def chat_delta(index: int, delta: dict, finish_reason: Optional[str] = None, logprobs: Optional[dict] = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
