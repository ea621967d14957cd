"""What a client sees when the engine refuses a request or breaks: OpenAI error bodies, and health says so.

The engine here is a stand-in with the DynamicInferenceEngine methods the serving loop calls, because a real
engine cannot be made to fail on demand; everything else (the serving loop thread, the app, uvicorn) is real."""

import httpx
import pytest

from megatron.core.inference.inference_request import DynamicInferenceRequest, Status
from megatron.core.inference.text_generation_server.server import TextGenerationServer
from megatron.core.tokenizers import GPT2BPETokenizer
from megatron.training import builtin_data


class _BrokenEngine:
    """Refuses prompts that start with token 0 (as the engine refuses what cannot fit); its step raises."""

    def __init__(self):
        self.requests = {}

    def add_request(self, request_id, prompt, sampling_params=None):
        if prompt[0] == 0:
            raise ValueError(f"request {request_id}: does not fit the KV cache")
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
        for request in self.requests.values():
            request.status = Status.ACTIVE_AND_GENERATING_TOKENS
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.fixture
def server():
    tokenizer = GPT2BPETokenizer(builtin_data.vocab_file(), builtin_data.merge_file())
    served = TextGenerationServer(_BrokenEngine(), tokenizer, model_name="broken", max_sequence_length=32)
    url = served.start()
    yield url
    served.stop()


def test_engine_refusal_is_a_400_and_engine_failure_a_500_then_503(server):
    refused = httpx.post(server + "/v1/completions", json={"prompt": [0, 5], "max_tokens": 2})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "request 0: does not fit the KV cache"

    failed = httpx.post(server + "/v1/completions", json={"prompt": [7, 5], "max_tokens": 2})
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "illegal memory access" in error["message"]

    health = httpx.get(server + "/health")
    assert health.status_code == 503 and "illegal memory access" in health.json()["error"]
    later = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert later.status_code == 503 and later.json()["error"]["code"] == "engine_unavailable"


def test_engine_failure_mid_stream_ends_the_stream_with_an_error_event(server):
    with httpx.stream(
        "POST",
        server + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True},
    ) as r:
        assert r.status_code == 200
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert '"role": "assistant"' in events[0]
    assert '"error"' in events[-2] and "illegal memory access" in events[-2]
    assert events[-1] == "data: [DONE]"
