"""Request bodies -> :class:`GenerationRequest`: every field checked for type and range, with OpenAI's errors.

The three request kinds (``/v1/completions``, ``/v1/chat/completions`` and Megatron's legacy ``PUT /api``) are
read here into one shape that the endpoints hand to the serving loop. Each check raises an
:class:`~.errors.OpenAIError` naming the parameter, the value and what is accepted, before anything reaches the
engine, so a bad request costs the running batch nothing. An explicit ``null`` means "the default", as in
OpenAI's API. A field the endpoint does not know is refused as OpenAI refuses it ("Unknown parameter: 'x'."),
unless the server was started to ignore unknown fields (``--ignore-unknown-request-fields``); OpenAI parameters that
only describe the caller (``user``, ``metadata``, ...) are accepted and ignored, and those this server does not
implement are refused when set to anything but their no-op value.

The parser runs on a worker thread (see :mod:`.routes`): tokenizing a long prompt takes seconds of CPU. A prompt
that cannot fit the context whatever its tokens (more non-space characters than the longest vocabulary entry times
the context length) is refused before it is tokenized.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from megatron.core.inference.text_generation_server.errors import (
    OpenAIError,
    above_maximum,
    below_minimum,
    invalid_type,
    missing_parameter,
)

MAX_N = 128
MAX_STOP_SEQUENCES = 4
MAX_LOGPROBS = 20
MAX_LEGACY_PROMPTS = 128
MAX_SEED = 2**63 - 1
# The server's default --max-request-body-bytes: 4 MiB holds a 128k-token prompt as text or as token ids.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024

_MISSING = object()
_WHITESPACE_RUNS = re.compile(r"\s+")

# OpenAI parameters this server does not implement, and the values that ask for nothing (so are accepted).
_NO_OP_VALUES = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
}
_CHAT_UNSUPPORTED = (
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "response_format",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
)

# The fields each endpoint knows: what it reads, the unsupported ones it refuses by name, and OpenAI's fields that
# only describe the caller or the storage of the reply (accepted, no effect here). Anything else is unknown.
_CALLER_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
_SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream")
_COMMON_FIELDS = _SAMPLING_FIELDS + ("stream_options", "frequency_penalty", "presence_penalty", "logit_bias")
COMPLETION_FIELDS = frozenset(_COMMON_FIELDS + _CALLER_FIELDS + ("prompt", "suffix", "best_of", "logprobs", "echo"))
CHAT_FIELDS = frozenset(
    _COMMON_FIELDS
    + _CALLER_FIELDS
    + _CHAT_UNSUPPORTED
    + ("messages", "logprobs", "top_logprobs", "max_completion_tokens", "parallel_tool_calls")
)
_LEGACY_UNSUPPORTED = ("beam_width", "prevent_newline_after_colon", "stop_token", "length_penalty")
LEGACY_FIELDS = frozenset(
    ("prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "top_p_decay", "top_p_bound")
    + ("add_BOS", "random_seed", "stop_on_eol", "stop_on_double_eol", "no_log")
    + _LEGACY_UNSUPPORTED
)
_STREAM_OPTIONS_FIELDS = frozenset(("include_usage", "include_obfuscation"))
_MESSAGE_FIELDS = frozenset(
    ("role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio", "function_call")
)


@dataclass
class ServingDefaults:
    """What a request gets for the sampling fields it leaves out (the server's ``--temperature`` etc.)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    max_tokens: int = 16  # OpenAI's default for completions; chat defaults to the rest of the context


@dataclass
class GenerationRequest:
    """One request, validated: ``n`` generations for each prompt (token ids), and how to sample and report them."""

    prompts: List[List[int]]
    prompt_texts: List[str]
    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    logprobs: Optional[int] = None  # None: no log-probs; k >= 0: the chosen token's plus the k most likely
    echo: bool = False
    stream: bool = False
    include_usage: bool = False


def parse_json_body(raw: bytes) -> Dict[str, Any]:
    """The request's JSON object, or a 400 saying why the body is not one."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise OpenAIError(
            f"The request body is not valid JSON ({error}). Send a JSON object with the header "
            f"'Content-Type: application/json'.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise OpenAIError(
            f"The request body must be a JSON object, got {type(body).__name__} ({str(body)[:40]}).",
            code="invalid_json",
        )
    return body


class RequestParser:
    """Reads request bodies for one served model: its tokenizer and its context length."""

    def __init__(
        self,
        tokenizer,
        max_sequence_length: int,
        defaults: Optional[ServingDefaults] = None,
        render_chat: Optional[Callable] = None,
        vocab_size: Optional[int] = None,
        ignore_unknown_fields: bool = False,
    ):
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length
        self.defaults = defaults or ServingDefaults()
        self.render_chat = render_chat
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.vocab_size
        self.ignore_unknown_fields = ignore_unknown_fields
        self.max_prompt_characters = _max_prompt_characters(tokenizer, max_sequence_length)

    # ---------------------------------------------------------------- the three request kinds

    def completion(self, body: Dict[str, Any]) -> GenerationRequest:
        self._check_fields(body, COMPLETION_FIELDS)
        self._check_model(body)
        self._refuse_unsupported(body, ("suffix", "best_of"))
        prompts, texts = self._completion_prompts(body)
        logprobs = _integer(body, "logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
        request = self._common(body, prompts, texts, "prompt", default_max_tokens=self.defaults.max_tokens)
        request.logprobs = logprobs
        request.echo = _boolean(body, "echo", False)
        return request

    def chat_completion(self, body: Dict[str, Any]) -> GenerationRequest:
        self._check_fields(body, CHAT_FIELDS)
        self._check_model(body)
        self._refuse_unsupported(body, _CHAT_UNSUPPORTED)
        messages = _chat_messages(body)
        for index, message in enumerate(body["messages"]):
            self._check_fields(message, _MESSAGE_FIELDS, f"messages[{index}].")
        self._check_prompt_characters(sum(_non_space_length(m["content"]) for m in messages), "messages")
        text = self.render_chat(messages)
        prompt = self.tokenizer.tokenize(text)
        self._check_prompt_tokens(prompt, "messages")
        logprobs = _boolean(body, "logprobs", False)
        top_logprobs = _integer(body, "top_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
        if top_logprobs is not None and not logprobs:
            raise OpenAIError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs", code="invalid_value")
        max_completion = _integer(body, "max_completion_tokens", None, minimum=1)
        default_max = max(1, self.max_sequence_length - len(prompt))
        request = self._common(
            body, [prompt], [text], "messages", default_max_tokens=default_max, max_tokens_override=max_completion
        )
        request.logprobs = (top_logprobs or 0) if logprobs else None
        return request

    def legacy(self, body: Dict[str, Any]) -> GenerationRequest:
        """Megatron's ``PUT /api`` fields: prompts, tokens_to_generate, logprobs, temperature, top_k, top_p,
        add_BOS, random_seed, stop_on_eol, stop_on_double_eol (and no_log, which changes nothing here)."""
        self._check_fields(body, LEGACY_FIELDS)
        prompts = body.get("prompts", _MISSING)
        if prompts is _MISSING or prompts is None:
            raise missing_parameter("prompts")
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise invalid_type("prompts", "an array of strings", prompts)
        if not prompts:
            raise OpenAIError("'prompts' is empty; send at least one prompt.", param="prompts", code="invalid_value")
        if len(prompts) > MAX_LEGACY_PROMPTS:
            raise above_maximum("prompts (count)", MAX_LEGACY_PROMPTS, len(prompts))
        add_bos = _boolean(body, "add_BOS", False)
        bos = getattr(self.tokenizer, "bos", -1)
        if add_bos and (bos is None or bos < 0):
            raise OpenAIError(
                "'add_BOS' is true but this tokenizer has no BOS token.", param="add_BOS", code="invalid_value"
            )
        for prompt in prompts:
            self._check_prompt_characters(_non_space_length(prompt), "prompts")
        token_lists = []
        for prompt in prompts:
            tokens = ([bos] if add_bos else []) + self.tokenizer.tokenize(prompt)
            self._check_prompt_tokens(tokens, "prompts")
            token_lists.append(tokens)
        max_tokens = _integer(body, "tokens_to_generate", 64, minimum=1)
        temperature = _number(body, "temperature", self.defaults.temperature, minimum=0.0, maximum=100.0)
        top_k = _integer(body, "top_k", self.defaults.top_k, minimum=0, maximum=1000)
        top_p = _number(body, "top_p", self.defaults.top_p, minimum=0.0, maximum=1.0)
        for name in _LEGACY_UNSUPPORTED + ("top_p_decay", "top_p_bound"):
            if body.get(name) not in (None, False, 0):
                raise OpenAIError(
                    f"'{name}' is not supported by this server; remove it.", param=name, code="unsupported_parameter"
                )
        stop = []
        if _boolean(body, "stop_on_double_eol", False):
            stop.append("\n\n")
        if _boolean(body, "stop_on_eol", False):
            stop.append("\n")
        request = GenerationRequest(
            prompts=token_lists,
            prompt_texts=list(prompts),
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=_integer(body, "random_seed", None, minimum=0, maximum=MAX_SEED),
            stop=stop,
            logprobs=0 if _boolean(body, "logprobs", False) else None,
            echo=True,
        )
        self._check_context(request, "tokens_to_generate", "prompts")
        return request

    # ---------------------------------------------------------------- shared pieces

    def _common(
        self,
        body,
        prompts,
        texts,
        prompt_param: str,
        default_max_tokens: int,
        max_tokens_override: Optional[int] = None,
    ) -> GenerationRequest:
        max_tokens = _integer(body, "max_tokens", default_max_tokens, minimum=1)
        if max_tokens_override is not None:
            max_tokens = max_tokens_override
        temperature = _number(body, "temperature", self.defaults.temperature, minimum=0.0, maximum=2.0)
        top_p = _number(body, "top_p", None, minimum=0.0, maximum=1.0)
        # OpenAI's top_p=1 (and vLLM's top_k=-1) mean "off", which Megatron's SamplingParams spells 0.
        top_p = self.defaults.top_p if top_p is None else (0.0 if top_p == 1.0 else top_p)
        top_k = _integer(body, "top_k", None, minimum=-1)
        top_k = self.defaults.top_k if top_k is None else max(top_k, 0)
        for name in ("frequency_penalty", "presence_penalty"):
            if _number(body, name, 0.0, minimum=-2.0, maximum=2.0) != 0.0:
                raise OpenAIError(
                    f"'{name}' is not supported by this server; leave it at 0.",
                    param=name,
                    code="unsupported_parameter",
                )
        if body.get("logit_bias"):
            raise OpenAIError(
                "'logit_bias' is not supported by this server.", param="logit_bias", code="unsupported_parameter"
            )
        stream = _boolean(body, "stream", False)
        stream_options = body.get("stream_options")
        include_usage = False
        if stream_options is not None:
            if not isinstance(stream_options, dict):
                raise invalid_type("stream_options", "an object", stream_options)
            if not stream:
                raise OpenAIError(
                    "'stream_options' is only allowed with 'stream': true.",
                    param="stream_options",
                    code="invalid_value",
                )
            self._check_fields(stream_options, _STREAM_OPTIONS_FIELDS, "stream_options.")
            include_usage = _boolean(stream_options, "include_usage", False, name="stream_options.include_usage")
        request = GenerationRequest(
            prompts=prompts,
            prompt_texts=texts,
            max_tokens=max_tokens,
            n=_integer(body, "n", 1, minimum=1, maximum=MAX_N),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=_integer(body, "seed", None, minimum=0, maximum=MAX_SEED),
            stop=_stop_sequences(body),
            stream=stream,
            include_usage=include_usage,
        )
        self._check_context(request, "max_completion_tokens" if max_tokens_override else "max_tokens", prompt_param)
        return request

    def _check_model(self, body) -> None:
        model = body.get("model")
        if model is None:
            return
        # Any name is served by the one model, as Megatron's server does: clients, evaluation harnesses and RL
        # agents send names of their own. The response's "model" field names what actually answered.
        if not isinstance(model, str):
            raise invalid_type("model", "a string", model)

    def _check_fields(self, body: Dict[str, Any], known, prefix: str = "") -> None:
        """A 400 naming the first field the endpoint does not know (OpenAI's answer), unless told to ignore them."""
        if self.ignore_unknown_fields:
            return
        for name in body:
            if name not in known:
                raise OpenAIError(
                    f"Unknown parameter: '{prefix}{name}'. Remove it, or start the server with "
                    "--ignore-unknown-request-fields to have fields it does not know ignored.",
                    param=f"{prefix}{name}",
                    code="unknown_parameter",
                )

    def _check_prompt_characters(self, characters: int, param: str) -> None:
        """Refuse, before tokenizing, text too long to fit whatever its tokens (see the module docstring)."""
        if self.max_prompt_characters is not None and characters > self.max_prompt_characters:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_sequence_length} tokens, and the {param} has "
                f"{characters} non-space characters, more than {self.max_sequence_length} tokens can hold with "
                f"this tokenizer (at most {self.max_prompt_characters}). Shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    @staticmethod
    def _refuse_unsupported(body, names) -> None:
        for name in names:
            if body.get(name) not in _NO_OP_VALUES[name]:
                raise OpenAIError(
                    f"'{name}' is not supported by this server; remove it.", param=name, code="unsupported_parameter"
                )

    def _completion_prompts(self, body):
        prompt = body.get("prompt", _MISSING)
        if prompt is _MISSING or prompt is None:
            raise missing_parameter("prompt")
        if isinstance(prompt, str):
            items = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            items = [prompt]
        elif (
            isinstance(prompt, list)
            and prompt
            and (
                all(isinstance(p, str) for p in prompt)
                or all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)
            )
        ):
            items = prompt
        elif isinstance(prompt, list) and not prompt:
            raise OpenAIError(
                "'prompt' is an empty array; send a string, an array of strings, an array of "
                "token ids or an array of arrays of token ids.",
                param="prompt",
                code="invalid_value",
            )
        else:
            raise invalid_type(
                "prompt",
                "a string, an array of strings, an array of token ids or an array of arrays of token ids",
                prompt,
            )
        for item in items:
            if isinstance(item, str):
                self._check_prompt_characters(_non_space_length(item), "prompt")
            elif item:
                self._check_prompt_tokens(item, "prompt")  # the length first: a long list is not scanned twice
        tokens, texts = [], []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer.tokenize(item)
                text = item
            else:
                bad = [t for t in item if not 0 <= t < self.vocab_size]
                if bad:
                    raise OpenAIError(
                        f"'prompt' holds token ids {bad[:5]} outside this model's vocabulary [0, {self.vocab_size}).",
                        param="prompt",
                        code="invalid_value",
                    )
                ids = list(item)
                text = self.tokenizer.detokenize(ids) if ids else ""
            self._check_prompt_tokens(ids, "prompt")
            tokens.append(ids)
            texts.append(text)
        return tokens, texts

    def _check_prompt_tokens(self, tokens: List[int], param: str) -> None:
        if not tokens:
            raise OpenAIError(
                f"'{param}' is empty after tokenization; send at least one token.", param=param, code="invalid_value"
            )
        if len(tokens) >= self.max_sequence_length:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_sequence_length} tokens, and the prompt has "
                f"{len(tokens)} tokens, which leaves no room to generate. Shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    def _check_context(self, request: GenerationRequest, max_tokens_param: str, prompt_param: str) -> None:
        longest = max(len(p) for p in request.prompts)
        if longest + request.max_tokens > self.max_sequence_length:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_sequence_length} tokens. However, you requested "
                f"{longest + request.max_tokens} tokens ({longest} in the {prompt_param}, {request.max_tokens} in "
                f"the completion). Reduce the length of the {prompt_param} or '{max_tokens_param}'.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )


def _max_prompt_characters(tokenizer, max_sequence_length: int) -> Optional[int]:
    """The most non-space characters a prompt of fewer than ``max_sequence_length`` tokens can have: each token
    covers at most as many characters as its vocabulary entry is long (in characters, or bytes for byte-level
    vocabularies, which is no fewer). None when the tokenizer does not show its vocabulary."""
    try:
        longest = max((len(entry) for entry in tokenizer.vocab), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return longest * max_sequence_length if longest > 0 else None


def _non_space_length(text: str) -> int:
    """Characters that are not whitespace (tokenizers may drop whitespace runs: only these bound the tokens)."""
    return len(text) - sum(len(run) for run in _WHITESPACE_RUNS.findall(text))


# -------------------------------------------------------------------- field readers


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body, name, default, minimum=None, maximum=None):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid_type(name, "an integer", value)
    _check_range(name, value, minimum, maximum)
    return value


def _number(body, name, default, minimum=None, maximum=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid_type(name, "a number", value)
    _check_range(name, value, minimum, maximum)
    return float(value)


def _boolean(body, key, default, name: Optional[str] = None):
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_type(name or key, "a boolean", value)
    return value


def _check_range(name, value, minimum, maximum) -> None:
    if minimum is not None and value < minimum:
        raise below_minimum(name, minimum, value)
    if maximum is not None and value > maximum:
        raise above_maximum(name, maximum, value)


def _stop_sequences(body) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid_type("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP_SEQUENCES:
        raise above_maximum("stop (count)", MAX_STOP_SEQUENCES, len(stop))
    if any(s == "" for s in stop):
        raise OpenAIError(
            "'stop' holds an empty string; every stop sequence needs at least one character.",
            param="stop",
            code="invalid_value",
        )
    return stop


_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _chat_messages(body) -> List[Dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` with text content (a string, or text parts joined)."""
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise missing_parameter("messages")
    if not isinstance(messages, list):
        raise invalid_type("messages", "an array", messages)
    if not messages:
        raise OpenAIError("'messages' is empty; send at least one message.", param="messages", code="invalid_value")
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid_type(where, "an object", message)
        role = message.get("role")
        if role is None:
            raise missing_parameter(f"{where}.role")
        if role not in _CHAT_ROLES:
            raise OpenAIError(
                f"Invalid '{where}.role': {role!r}. Supported roles: {', '.join(_CHAT_ROLES)}.",
                param=f"{where}.role",
                code="invalid_value",
            )
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for part_index, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(
                        f"'{where}.content[{part_index}]' is not a text part "
                        f"({{'type': 'text', 'text': ...}}); this server reads text only.",
                        param=f"{where}.content",
                        code="invalid_value",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise invalid_type(f"{where}.content", "a string or an array of text parts", content)
        out.append({"role": role, "content": content})
    return out
