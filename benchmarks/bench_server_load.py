"""Load test of the text generation server: does ``/health`` stay fast while clients send big, slow and broken
requests?

``--clients`` concurrent clients (default 32) send requests for ``--duration`` seconds on loopback, each drawing
its next request from a fixed mix: short completions, streamed chat completions, clients that disconnect after the
first streamed token, prompts that fit but take real tokenizer work, prompts far too long for the context (refused
before tokenizing), and bodies over the server's body limit (refused with a 413 from their Content-Length). A
separate process asks ``/health`` every ``--health-interval`` seconds on its own connection and records the
latency. Prints ``/health`` p50 / p99 / max and each request kind's outcomes as tables (goal: p99 < 100 ms), and
writes benchmarks/results/server_load.json.

Without ``--url`` it serves a small random GPT (GPT-2 BPE tokenizer, 2 layers, hidden 64, 512 positions, 16
concurrent requests, one torch thread) from a subprocess of this script; with ``--url`` it loads a running server
(tools/run_text_generation_server.py).

    python benchmarks/bench_server_load.py [--clients 32 --duration 20 --health-interval 0.05 --seed 0]
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MAX_SEQUENCE_LENGTH = 512
OVERSIZED_BODY_BYTES = 5 * 1024 * 1024  # over the default 4 MiB limit
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def serve(port: int) -> None:
    """The built-in server (a subprocess of this script): a random tiny GPT on the real engine and server."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.inference.contexts import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers import TextGenerationController
    from megatron.core.inference.text_generation_server.server import TextGenerationServer, listen_socket
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tokenizers import GPT2BPETokenizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import builtin_data

    listener = listen_socket("127.0.0.1", port)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port + 1))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    tokenizer = GPT2BPETokenizer(builtin_data.vocab_file(), builtin_data.merge_file())
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True,
    )  # fmt: skip
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=tokenizer.vocab_size, max_sequence_length=MAX_SEQUENCE_LENGTH
    ).eval()
    context = DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=2, kv_channels=16, num_attention_heads=4,
        max_sequence_length=MAX_SEQUENCE_LENGTH, block_size_tokens=64, num_blocks=16 * 8, max_requests=16,
        max_tokens=1024,
    )  # fmt: skip
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), tokenizer), context)
    TextGenerationServer(engine, tokenizer, model_name="tiny", max_sequence_length=MAX_SEQUENCE_LENGTH).run(
        sock=listener
    )


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def request_kinds(rng: random.Random):
    """(name, weight, method, path, body bytes, streamed, disconnect after the first event); bodies built once."""

    def body(obj) -> bytes:
        return json.dumps(obj).encode()

    chat = [{"role": "user", "content": _text(rng, 20)}]
    return [
        ("completion", 30, "POST", "/v1/completions", body({"prompt": _text(rng, 12), "max_tokens": 16}), False, False),
        ("chat stream", 20, "POST", "/v1/chat/completions", body({"messages": chat, "max_tokens": 16, "stream": True}),
         True, False),
        ("disconnect", 10, "POST", "/v1/completions", body({"prompt": _text(rng, 12), "max_tokens": 200,
                                                             "stream": True}), True, True),
        ("tokenizer-heavy", 10, "POST", "/v1/completions", body({"prompt": _text(rng, 280), "max_tokens": 8}), False,
         False),
        ("too long (1 MB)", 15, "POST", "/v1/completions", body({"prompt": "x" * 1_000_000}), False, False),
        ("body > limit", 15, "POST", "/v1/chat/completions",
         body({"messages": [{"role": "user", "content": "y" * OVERSIZED_BODY_BYTES}]}), False, False),
    ]  # fmt: skip


async def client(http, url, kinds, rng, deadline, outcomes):
    names, weights = [k[0] for k in kinds], [k[1] for k in kinds]
    by_name = {k[0]: k for k in kinds}
    while time.monotonic() < deadline:
        name, _, method, path, body, streamed, disconnect = by_name[rng.choices(names, weights)[0]]
        start = time.monotonic()
        headers = {"Content-Type": "application/json"}
        try:
            if streamed:
                async with http.stream(method, url + path, content=body, headers=headers) as response:
                    status = response.status_code
                    async for line in response.aiter_lines():
                        if disconnect and line.startswith("data: {"):
                            status = "disconnected"
                            break
            else:
                status = (await http.request(method, url + path, content=body, headers=headers)).status_code
        except Exception as error:  # an outcome to count, not a reason to stop the load
            status = type(error).__name__
        outcomes.append((name, str(status), time.monotonic() - start))


def probe_health(url, interval, duration, queue) -> None:
    """A separate process: GET /health every ``interval`` s for ``duration`` s; puts the latencies (s)."""
    import httpx

    latencies, failures = [], 0
    with httpx.Client(timeout=30) as http:
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            start = time.perf_counter()
            try:
                ok = http.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start)
            failures += not ok
            time.sleep(max(0.0, interval - (time.perf_counter() - start)))
    queue.put((latencies, failures))


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


async def load(args, url):
    import httpx

    rng = random.Random(args.seed)
    kinds = request_kinds(rng)
    outcomes = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        deadline = time.monotonic() + args.duration
        await asyncio.gather(
            *[client(http, url, kinds, random.Random(args.seed + i), deadline, outcomes) for i in range(args.clients)]
        )
    return outcomes


def start_server():
    import httpx

    from tests.functional_tests.harness import free_port

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    process = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise SystemExit("the benchmark server did not start (see its output above)")


def engine_after_load(url):
    """/health's request counts once the engine has drained (up to 60 s): whether disconnects freed their slots."""
    import httpx

    deadline = time.monotonic() + 60
    while True:
        requests = httpx.get(url + "/health", timeout=30).json().get("requests", {})
        if requests.get("in_engine", 0) == 0 or time.monotonic() > deadline:
            return requests
        time.sleep(0.2)


def report(args, latencies, health_failures, outcomes, engine):
    print(f"\n/health under load ({args.clients} clients, {args.duration:.0f} s, every {args.health_interval} s)")
    print("| probes | failed | p50 (ms) | p99 (ms) | max (ms) |\n|---|---|---|---|---|")
    p50, p99 = percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3
    print(f"| {len(latencies)} | {health_failures} | {p50:.1f} | {p99:.1f} | {max(latencies) * 1e3:.1f} |")
    print("\nrequests\n| kind | outcome | count | p50 (s) | max (s) |\n|---|---|---|---|---|")
    rows = {}
    for name, status, seconds in outcomes:
        rows.setdefault((name, status), []).append(seconds)
    for (name, status), times in sorted(rows.items()):
        print(f"| {name} | {status} | {len(times)} | {percentile(times, 0.5):.3f} | {max(times):.3f} |")
    disconnects = sum(1 for _, status, _ in outcomes if status == "disconnected")
    print(f"\nafter the load: /health says {engine} ({disconnects} clients disconnected mid-stream)")
    verdict = "met" if p99 < 100 else "NOT met"
    print(f"\ngoal /health p99 < 100 ms: {verdict} ({p99:.1f} ms)")
    results = REPO_ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    summary = {
        "args": vars(args),
        "health_ms": {"p50": p50, "p99": p99, "max": max(latencies) * 1e3, "probes": len(latencies)},
        "health_failures": health_failures,
        "engine_after_load": engine,
        "requests": {f"{name} -> {status}": len(times) for (name, status), times in sorted(rows.items())},
    }
    (results / "server_load.json").write_text(json.dumps(summary, indent=2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="load this running server instead of starting the built-in one")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--health-interval", type=float, default=0.05, help="seconds between /health probes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the built-in server's subprocess
    args = parser.parse_args()
    if args.serve is not None:
        return serve(args.serve)
    if args.clients < 1 or args.duration <= 0 or args.health_interval <= 0:
        parser.error("--clients, --duration and --health-interval must be positive")
    process, url = (None, args.url) if args.url else start_server()
    try:
        queue = multiprocessing.Queue()
        prober = multiprocessing.Process(
            target=probe_health, args=(url, args.health_interval, args.duration, queue), daemon=True
        )
        prober.start()
        outcomes = asyncio.run(load(args, url))
        latencies, health_failures = queue.get(timeout=args.duration + 120)
        prober.join(30)
        engine = engine_after_load(url)
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    report(args, latencies, health_failures, outcomes, engine)


if __name__ == "__main__":
    main()
