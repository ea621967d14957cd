"""No single request stalls the server: bodies over the limit are refused before they are read, parsing and
tokenizing run off the event loop (``/health`` and other clients are answered meanwhile), a client that goes away
has its generation cancelled, and unknown request fields are ignored when the server is told to.

Each check is an ordering, not a timing: the server answers while a request is provably still in flight (held in
the tokenizer, or still generating, or with its body still unsent). Timeouts only turn a stall into a failure."""

import asyncio
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest

from megatron.core.inference.inference_request import DynamicInferenceRequest, Status
from megatron.core.inference.text_generation_server.server import TextGenerationServer
from megatron.core.tokenizers import GPT2BPETokenizer
from megatron.training import builtin_data
from tests.unit_tests.inference.text_generation_server import tiny_server

BODY_LIMIT = 65536
STALL_S = 60  # far beyond any answer here: a request that waits this long was blocked


@pytest.fixture(scope="module")
def slow_server():
    """The tiny model at 50 ms an engine step (a 40-token generation lasts 2 s), a 64 KiB body limit, and unknown
    fields ignored."""
    with tiny_server.running(
        "--step-delay", "0.05", "--max-request-body-bytes", str(BODY_LIMIT), "--ignore-unknown-request-fields"
    ) as url:
        yield url


def _health(url):
    response = httpx.get(url + "/health", timeout=STALL_S)
    assert response.status_code == 200, response.text
    return response.json()["requests"]


def _raw_request(url, head: bytes) -> socket.socket:
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=STALL_S)
    sock.sendall(head)
    return sock


def _read_response(sock: socket.socket):
    """Status code and JSON body of the response on ``sock`` (its body is short and has a Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def test_a_declared_body_over_the_limit_is_refused_before_a_byte_of_it_is_sent(slow_server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    with _raw_request(slow_server, head + b"Content-Length: 10000000\r\n\r\n") as sock:
        status, body = _read_response(sock)  # the body is never sent: the answer did not wait for it
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert body["error"]["message"].startswith(
        f"The request body is 10000000 bytes, over this server's limit of {BODY_LIMIT} bytes."
    )


def test_a_chunked_body_is_refused_once_it_passes_the_limit_without_being_read_to_its_end(slow_server):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"
    sent = 0
    with _raw_request(slow_server, head) as sock:
        # Send until the server answers; the body's last chunk is never sent, so an answer means it stopped early.
        while sent < 1024 * 1024 * 1024:
            readable, writable, _ = select.select([sock], [sock], [], STALL_S)
            if readable:
                break
            assert writable, "the server neither read more of the body nor answered"
            sock.sendall(chunk)
            sent += 0x4000
        status, body = _read_response(sock)
    assert status == 413
    assert body["error"]["message"].startswith(
        f"The request body (sent without a Content-Length) is longer than this server's limit of {BODY_LIMIT} bytes."
    )
    assert sent > BODY_LIMIT  # it was refused for its length, not for its first bytes


def test_unknown_fields_are_ignored_when_the_server_is_told_to(slow_server):
    replies = [
        httpx.post(
            slow_server + "/v1/completions",
            json={"prompt": "x", "max_tokens": 1, "frobnicate": 1, "stream": True, "stream_options": {"extra": 1}},
        ),
        httpx.post(
            slow_server + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x", "colour": "red"}], "max_tokens": 1, "tone": "dry"},
        ),
        httpx.put(slow_server + "/api", json={"prompts": ["x"], "tokens_to_generate": 1, "temperatur": 1}),
    ]
    assert [reply.status_code for reply in replies] == [200, 200, 200], [reply.text for reply in replies]


async def _until(condition, url):
    """Poll /health until ``condition(requests)`` holds; the last reading."""
    deadline = time.monotonic() + STALL_S
    async with httpx.AsyncClient(timeout=STALL_S) as health:
        while True:
            requests = (await health.get(url + "/health")).json()["requests"]
            if condition(requests) or time.monotonic() > deadline:
                return requests
            await asyncio.sleep(0.05)


def test_health_answers_during_a_generation_and_a_disconnected_client_frees_its_slot(slow_server):
    """A streaming and a non-streaming client go away mid-generation (40 tokens at 50 ms a step): both requests
    leave the engine cancelled, and the next request is served."""
    cancelled_before = _health(slow_server)["cancelled"]
    request = {"prompt": "To be, or not to be", "max_tokens": 40, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(timeout=STALL_S) as client:
            async with client.stream("POST", slow_server + "/v1/completions", json={**request, "stream": True}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: {"):
                        break  # generating: the first token arrived
                during = await _until(lambda r: r["in_engine"] >= 1, slow_server)
            whole = asyncio.ensure_future(client.post(slow_server + "/v1/completions", json=request))
            both = await _until(lambda r: r["in_engine"] >= 1 and not whole.done(), slow_server)
            whole.cancel()  # the non-streaming client gives up: its connection closes
        after = await _until(lambda r: r["cancelled"] >= cancelled_before + 2 and r["in_engine"] == 0, slow_server)
        return during, both, after

    during, both, after = asyncio.run(scenario())
    assert during["in_engine"] == 1, "/health answered while the streamed generation ran"
    assert both["in_engine"] >= 1
    assert after == {"in_engine": 0, "cancelled": cancelled_before + 2}
    reply = httpx.post(slow_server + "/v1/completions", json={**request, "max_tokens": 2}, timeout=STALL_S)
    assert reply.json()["usage"]["completion_tokens"] == 2


class _GatedTokenizer(GPT2BPETokenizer):
    """Holds any text containing "GATE" in ``tokenize`` until released, as a huge prompt would hold it."""

    def __init__(self):
        super().__init__(builtin_data.vocab_file(), builtin_data.merge_file())
        self.entered = threading.Event()
        self.release = threading.Event()

    def tokenize(self, text):
        if "GATE" in text:
            self.entered.set()
            self.release.wait(STALL_S)
        return super().tokenize(text)


class _OneTokenEngine:
    """Finishes every request with one token at its first step (the model is beside the point here)."""

    def __init__(self):
        self.requests = {}

    def add_request(self, request_id, prompt, sampling_params=None):
        self.requests[request_id] = DynamicInferenceRequest(
            request_id=request_id, prompt_tokens=list(prompt), sampling_params=sampling_params
        )

    def has_unfinished_requests(self):
        return any(not r.finished for r in self.requests.values())

    def get_request(self, request_id):
        return self.requests[request_id]

    def pop_request(self, request_id):
        return self.requests.pop(request_id)

    def step_modern(self):
        finished = [r for r in self.requests.values() if not r.finished]
        for request in finished:
            request.generated_tokens.append(11)
            request.status = Status.COMPLETED
        return [], finished, 0.0


def test_health_and_other_clients_are_answered_while_a_prompt_is_being_tokenized():
    tokenizer = _GatedTokenizer()
    server = TextGenerationServer(_OneTokenEngine(), tokenizer, model_name="gated", max_sequence_length=64)
    url = server.start()
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                httpx.post,
                url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "GATE"}], "max_tokens": 1},
                timeout=STALL_S,
            )
            assert tokenizer.entered.wait(STALL_S), "the gated request never reached the tokenizer"
            health = httpx.get(url + "/health", timeout=STALL_S)
            other = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=STALL_S)
            still_held = not held.done()
            tokenizer.release.set()
            gated = held.result()
    finally:
        tokenizer.release.set()
        server.stop()
    assert health.json()["status"] == "ok"
    assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 1
    assert still_held, "the gated request was still being tokenized while the others were answered"
    assert gated.status_code == 200, gated.text
