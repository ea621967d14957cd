"""Serve a small random GPT with the built-in GPT-2 BPE tokenizer on one gloo rank (the server tests' subprocess).

    python tests/unit_tests/inference/text_generation_server/tiny_server.py PORT [--step-delay S]
        [--max-request-body-bytes N] [--ignore-unknown-request-fields]

The model, its engine and the server are the real ones; only the weights are random (seeded), so greedy output is
deterministic. ``--step-delay`` sleeps that long before each engine step, so a generation lasts long enough for a
test to act while it runs (disconnect, ask for /health). Stops on SIGTERM / SIGINT.
"""

import argparse
import contextlib
import os
import signal
import subprocess
import time
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core import parallel_state  # noqa: E402
from megatron.core.inference.contexts import DynamicInferenceContext  # noqa: E402
from megatron.core.inference.engines import DynamicInferenceEngine  # noqa: E402
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (  # noqa: E402
    GPTInferenceWrapper,
)
from megatron.core.inference.text_generation_controllers import TextGenerationController  # noqa: E402
from megatron.core.inference.text_generation_server.server import (  # noqa: E402
    TextGenerationServer,
    listen_socket,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.tokenizers import GPT2BPETokenizer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.training import builtin_data  # noqa: E402

MODEL_NAME = "tiny-gpt"
MAX_SEQUENCE_LENGTH = 64
MAX_REQUESTS = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running(*options: str):
    """A tiny server in a subprocess with these command-line ``options``; yields its base URL once /health answers,
    and stops it (SIGINT, then SIGKILL after 30 s) on exit."""
    import httpx

    from tests.functional_tests.harness import free_port

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, __file__, str(port), *options],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}:\n{process.stdout.read()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--max-request-body-bytes", type=int, default=None)
    parser.add_argument("--ignore-unknown-request-fields", action="store_true")
    options = parser.parse_args(argv)
    listener = listen_socket("127.0.0.1", options.port)  # first, so the process group's ports cannot take it
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    tokenizer = GPT2BPETokenizer(builtin_data.vocab_file(), builtin_data.merge_file())
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=tokenizer.vocab_size, max_sequence_length=MAX_SEQUENCE_LENGTH
    ).eval()
    context = DynamicInferenceContext(
        params_dtype=torch.float32,
        num_layers=2,
        kv_channels=8,
        num_attention_heads=4,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        block_size_tokens=16,
        num_blocks=MAX_REQUESTS * 4,
        max_requests=MAX_REQUESTS,
        max_tokens=256,
    )
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), tokenizer), context)
    if options.step_delay:
        step = engine.step_modern

        def slow_step():
            time.sleep(options.step_delay)
            return step()

        engine.step_modern = slow_step
    limits = {"ignore_unknown_fields": options.ignore_unknown_request_fields}
    if options.max_request_body_bytes is not None:
        limits["max_request_body_bytes"] = options.max_request_body_bytes
    server = TextGenerationServer(
        engine, tokenizer, model_name=MODEL_NAME, max_sequence_length=MAX_SEQUENCE_LENGTH, **limits
    )
    server.run(sock=listener)


if __name__ == "__main__":
    main(sys.argv[1:])
