"""The OpenAI-compatible server end to end: a real server process (tiny random GPT, dynamic engine, uvicorn)
called with the official ``openai`` client, and with raw bad requests through ``httpx``."""

import asyncio

import httpx
import openai
import pytest

from megatron.core.inference.text_generation_server.chat_template import default_chat_prompt
from megatron.core.tokenizers import GPT2BPETokenizer
from megatron.training import builtin_data
from tests.unit_tests.inference.text_generation_server import tiny_server
from tests.unit_tests.inference.text_generation_server.tiny_server import MAX_REQUESTS, MAX_SEQUENCE_LENGTH, MODEL_NAME

PROMPTS = [
    "To be, or not to be",
    "Friends, Romans, countrymen",
    "Now is the winter",
    "O Romeo",
    "All the world",
    "Once more unto the breach",
    "What light through yonder",
    "The quality of mercy",
]


@pytest.fixture(scope="module")
def tokenizer():
    return GPT2BPETokenizer(builtin_data.vocab_file(), builtin_data.merge_file())


@pytest.fixture(scope="module")
def base_url():
    with tiny_server.running() as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as opened:
        yield opened  # closed before the server stops, so no kept-alive connection delays its shutdown


def _greedy(client, prompt, max_tokens=8, **kwargs):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs)


def test_any_model_name_is_served_by_the_one_model_and_named_in_the_reply(client):
    """Like Megatron's server: clients, evaluation harnesses and RL agents send names of their own."""
    named = _greedy(client, PROMPTS[0], max_tokens=4)
    other = client.completions.create(model="gpt-9", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert other.model == MODEL_NAME and other.choices[0].text == named.choices[0].text
    chat = client.chat.completions.create(
        model="my-agent", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=2, temperature=0
    )
    assert chat.model == MODEL_NAME and chat.usage.completion_tokens == 2


def test_health_and_models(base_url, client):
    for path in ("/health", "/v1/health"):
        assert httpx.get(base_url + path).json() == {"status": "ok", "requests": {"in_engine": 0, "cancelled": 0}}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_completion_usage_logprobs_and_streaming_equal_non_streaming(client, tokenizer):
    prompt = PROMPTS[0]
    full = _greedy(client, prompt, logprobs=2)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == MODEL_NAME
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.tokenize(prompt))
    assert full.usage.completion_tokens == 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8
    assert "".join(choice.logprobs.tokens) == choice.text
    assert len(choice.logprobs.token_logprobs) == 8
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    # Greedy: each chosen token is the most likely one.
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert lp == pytest.approx(max(top.values()), abs=1e-5)

    chunks = list(_greedy(client, prompt, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8

    # Without the /v1 prefix too, and echo puts the prompt in front.
    plain = httpx.post(
        str(client.base_url).replace("/v1/", "/completions"),
        json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "echo": True},
    ).json()
    assert plain["choices"][0]["text"] == prompt + choice.text


def test_sse_wire_format(base_url):
    with httpx.stream(
        "POST",
        base_url + "/v1/completions",
        json={"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(event.startswith("data: {") for event in events[:-2])


def test_chat_completion_and_streaming(client, tokenizer):
    messages = [{"role": "system", "content": "Speak in verse."}, {"role": "user", "content": "Who art thou?"}]
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1
    )
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert full.usage.prompt_tokens == len(tokenizer.tokenize(default_chat_prompt(messages)))
    assert full.usage.completion_tokens == 6
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content

    chunks = list(
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_n_choices_are_seeded_and_ordered(client):
    request = dict(
        model=MODEL_NAME, prompt=[PROMPTS[2], PROMPTS[3]], max_tokens=6, n=2, seed=11, temperature=1.0, echo=True
    )
    first = client.completions.create(**request)
    again = client.completions.create(**request)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]  # same seed, same samples
    assert [t.startswith(PROMPTS[2]) for t in texts] == [True, True, False, False]  # choice i*n+j: prompt i
    assert texts[0] != texts[1]  # the n samples of one prompt differ
    assert first.usage.completion_tokens == 4 * 6

    streamed = client.completions.create(**{**request, "echo": False}, stream=True)
    pieces = {}
    for chunk in streamed:
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + c.text
    prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[3], PROMPTS[3]]
    assert [prompts[i] + pieces[i] for i in range(4)] == texts


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(base_url, client):
    # More requests than the engine runs at once (MAX_REQUESTS): the rest wait in its queue and join as others end.
    prompts = (PROMPTS + PROMPTS)[: MAX_REQUESTS + 4]
    lengths = [4 + i % 7 for i in range(len(prompts))]
    alone = [_greedy(client, p, max_tokens=n).choices[0].text for p, n in zip(prompts, lengths)]

    async def together():
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(
                *[
                    aclient.completions.create(model=MODEL_NAME, prompt=p, max_tokens=n, temperature=0)
                    for p, n in zip(prompts, lengths)
                ]
            )

    results = asyncio.run(together())
    assert [r.choices[0].text for r in results] == alone
    assert [r.usage.completion_tokens for r in results] == lengths


def test_stop_sequence_ends_the_text_before_it(client):
    reference = _greedy(client, PROMPTS[4], max_tokens=12).choices[0].text
    stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
    expected = reference[: reference.index(stop)]
    stopped = _greedy(client, PROMPTS[4], max_tokens=12, stop=[stop]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (expected, "stop")
    streamed = "".join(c.choices[0].text for c in _greedy(client, PROMPTS[4], max_tokens=12, stop=stop, stream=True))
    assert streamed == expected


def test_legacy_put_api(base_url, client):
    prompt = PROMPTS[5]
    reply = httpx.put(
        base_url + "/api", json={"prompts": [prompt], "tokens_to_generate": 5, "top_k": 1, "logprobs": True}
    ).json()
    completion = _greedy(client, prompt, max_tokens=5, echo=True, logprobs=0).choices[0]
    assert reply["text"] == [completion.text]
    assert "".join(reply["segments"][0]) == completion.text
    assert reply["logprobs"][0] == pytest.approx(completion.logprobs.token_logprobs[1:], abs=1e-5)


_LONG_PROMPT = " ".join(["word"] * MAX_SEQUENCE_LENGTH)

BAD_REQUESTS = [
    # (method, path, body (bytes: sent raw), status, param, code, words of the message)
    ("POST", "/v1/completions", b"{not json", 400, None, "invalid_json", "not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, None, "invalid_json", "must be a JSON object"),
    ("POST", "/v1/completions", {"max_tokens": 3}, 400, "prompt", "missing_required_parameter", "'prompt'"),
    ("POST", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages", "missing_required_parameter", "'messages'"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "below_min_value", "-1"),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "max_tokens": "5"},
        400,
        "max_tokens",
        "invalid_type",
        "expected an integer, but got a string",
    ),
    ("POST", "/v1/completions", {"prompt": 7}, 400, "prompt", "invalid_type", "'prompt'"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature", "above_max_value", "3"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "invalid_type", "boolean"),
    (
        "POST",
        "/v1/completions",
        {"prompt": _LONG_PROMPT},
        400,
        "prompt",
        "context_length_exceeded",
        f"maximum context length is {MAX_SEQUENCE_LENGTH} tokens",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "max_tokens": MAX_SEQUENCE_LENGTH},
        400,
        "max_tokens",
        "context_length_exceeded",
        "Reduce the length",
    ),
    ("POST", "/v1/completions", {"prompt": "x", "model": 7}, 400, "model", "invalid_type", "model"),
    ("POST", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "invalid_value", "outside"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "below_min_value", "n"),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
        400,
        "stop (count)",
        "above_max_value",
        "4",
    ),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "above_max_value", "20"),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "invalid_value",
        "stream",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "presence_penalty": 0.5},
        400,
        "presence_penalty",
        "unsupported_parameter",
        "not supported",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        "invalid_value",
        "wizard",
    ),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", "invalid_type", "array"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        "invalid_value",
        "'logprobs': true",
    ),
    ("PUT", "/api", {"tokens_to_generate": 3}, 400, "prompts", "missing_required_parameter", "'prompts'"),
    ("PUT", "/api", {"prompts": "x"}, 400, "prompts", "invalid_type", "array of strings"),
    ("PUT", "/api", {"prompts": ["x"], "tokens_to_generate": -3}, 400, "tokens_to_generate", "below_min_value", "-3"),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 1, "frobnicate": 1},
        400,
        "frobnicate",
        "unknown_parameter",
        "Unknown parameter: 'frobnicate'. Remove it, or start the server with --ignore-unknown-request-fields",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "chunk_size": 4}},
        400,
        "stream_options.chunk_size",
        "unknown_parameter",
        "Unknown parameter: 'stream_options.chunk_size'",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temprature": 0.5},
        400,
        "temprature",
        "unknown_parameter",
        "Unknown parameter: 'temprature'",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "colour": "red"}]},
        400,
        "messages[0].colour",
        "unknown_parameter",
        "Unknown parameter: 'messages[0].colour'",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"},
        400,
        "reasoning_effort",
        "unsupported_parameter",
        "'reasoning_effort' is not supported by this server",
    ),
    ("PUT", "/api", {"prompts": ["x"], "temperatur": 1}, 400, "temperatur", "unknown_parameter", "'temperatur'"),
    ("PUT", "/api", {"prompts": ["x"], "top_p_decay": 0.5}, 400, "top_p_decay", "unsupported_parameter", "remove it"),
    ("GET", "/v1/nothing-here", None, 404, None, "unknown_url", "/v1/nothing-here"),
    ("GET", "/v1/completions", None, 405, None, "method_not_allowed", "GET"),
    ("GET", "/v1/models/gpt-9", None, 404, "model", "model_not_found", "'gpt-9'"),
]


@pytest.mark.parametrize(
    "method,path,body,status,param,code,words",
    BAD_REQUESTS,
    ids=[f"{case[1]}-{case[5]}-{i}" for i, case in enumerate(BAD_REQUESTS)],
)
def test_bad_request_gets_openai_error_body(base_url, method, path, body, status, param, code, words):
    kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
    response = httpx.request(method, base_url + path, headers={"Content-Type": "application/json"}, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == ("invalid_request_error" if status in (400, 405, 413) else "not_found_error")
    assert words in error["message"]


def test_openai_client_raises_with_the_message_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length") as raised:
        client.completions.create(model=MODEL_NAME, prompt=_LONG_PROMPT, max_tokens=1)
    assert raised.value.code == "context_length_exceeded"
    assert _greedy(client, PROMPTS[0], max_tokens=2).usage.completion_tokens == 2


def test_callers_own_openai_fields_are_accepted(client):
    """OpenAI's fields that only describe the caller are known fields: accepted, with no effect here."""
    reply = _greedy(client, PROMPTS[0], max_tokens=1, user="u-1", extra_body={"metadata": {"k": "v"}, "store": False})
    assert reply.usage.completion_tokens == 1


@pytest.mark.parametrize(
    "method,path,field",
    [("POST", "/v1/completions", "prompt"), ("POST", "/v1/chat/completions", "messages"), ("PUT", "/api", "prompts")],
)
def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(base_url, tokenizer, method, path, field):
    """More non-space characters than the context can hold with this vocabulary's longest entry: refused by its
    length (the message counts characters, not tokens: nothing was tokenized)."""
    limit = max(len(entry) for entry in tokenizer.vocab) * MAX_SEQUENCE_LENGTH
    text = "x" * (limit + 1) + " " * 1000  # the spaces do not count
    value = {"prompt": text, "messages": [{"role": "user", "content": text}], "prompts": [text]}[field]
    response = httpx.request(method, base_url + path, json={field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, "context_length_exceeded")
    assert f"has {limit + 1} non-space characters, more than {MAX_SEQUENCE_LENGTH} tokens can hold" in error["message"]


def test_a_body_over_the_default_limit_is_413_json_and_the_server_keeps_serving(base_url, client):
    """The issue's case: a 10 MB chat message (the default limit is 4 MiB), refused from its Content-Length."""
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * 10_000_000 + b'"}]}'
    response = httpx.post(base_url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "request_too_large")
    assert error["message"].startswith(f"The request body is {len(body)} bytes, over this server's limit of 4194304")
    assert "--max-request-body-bytes" in error["message"]
    assert _greedy(client, PROMPTS[0], max_tokens=1).usage.completion_tokens == 1
