"""Core attention forward + backward time per ``--attention-backend`` on CPU, side by side.

``DotProductAttention`` (one layer's core attention, fp32, training mode without dropout) at a few sequence lengths
for three layouts: multi-head causal, grouped-query causal (8 query heads over 2 key/value heads) and grouped-query
with a sliding window of 256 keys. Each repeat times every backend once, in turn (interleaved, so a busy machine
slows them alike); the table shows the median per backend in ms and its speed-up over ``unfused``. On CPU ``local``
runs the same explicit path as ``unfused``, and ``flash`` the same SDPA as ``fused`` (``flash`` with a window needs
the Triton kernel, i.e. CUDA: shown as n/a). A last table compares SDPA's in-place grouped-query read
(``enable_gqa``, what the SDPA backends use) with copying the key/value heads first, and another one block of
context-parallel ring attention computed explicitly (``unfused`` / ``local``) and by ATen's fused CPU flash kernel
(the SDPA backends).

    python benchmarks/bench_attention.py [--seq 256 1024 2048 --batch 2 --repeats 5 --threads 2]

Prints the tables and writes benchmarks/results/attention.json.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.context_parallel.blockwise import (  # noqa: E402
    block_backward,
    block_forward,
    fused_block_backward,
    fused_block_forward,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnBackend, AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

BACKENDS = ("unfused", "local", "fused", "flash", "auto")
HEADS, HEAD_DIM = 8, 64
LAYOUTS = {
    "MHA causal": dict(num_query_groups=HEADS),
    "GQA 8/2 causal": dict(num_query_groups=2),
    "GQA 8/2 window 256": dict(num_query_groups=2, window_size=(256, 0)),
}


def _module(backend: str, layout: dict):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        attention_dropout=0.0,
        attention_backend=AttnBackend[backend],
        **layout,
    )
    try:
        return DotProductAttention(config, 1, AttnMaskType.causal, "self")
    except ValueError:  # flash with a window off CUDA: refused, as documented
        return None


def _time_step(run, q, k, v) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    out = run(q, k, v)
    out.backward(torch.ones_like(out))
    return (time.perf_counter() - start) * 1e3


def _inputs(seq: int, batch: int, groups: int):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, batch, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(seq, batch, groups, HEAD_DIM, generator=gen) for _ in range(2))
    return q, k, v


def _backend_table(args) -> list:
    rows = []
    for seq in args.seq:
        for name, layout in LAYOUTS.items():
            modules = {backend: _module(backend, layout) for backend in BACKENDS}
            q, k, v = _inputs(seq, args.batch, layout["num_query_groups"])
            times = {backend: [] for backend, module in modules.items() if module is not None}
            for repeat in range(args.repeats + 1):
                for backend in times:
                    elapsed = _time_step(lambda a, b, c, m=modules[backend]: m(a, b, c, None), q, k, v)
                    if repeat:  # the first round warms up
                        times[backend].append(elapsed)
            medians = {backend: statistics.median(values) for backend, values in times.items()}
            rows.append({"seq": seq, "layout": name, "ms": medians})
            cells = [
                f"{medians[b]:9.1f} ({medians['unfused'] / medians[b]:4.2f}x)" if b in medians else f"{'n/a':>17}"
                for b in BACKENDS
            ]
            print(f"{seq:6d} {name:20s} " + " ".join(cells), flush=True)
    return rows


def _gqa_table(args) -> list:
    rows = []
    for seq in args.seq:
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in _inputs(seq, args.batch, 2))

        def in_place(a, b, c):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

        def copied(a, b, c):
            b, c = b.repeat_interleave(HEADS // 2, dim=1), c.repeat_interleave(HEADS // 2, dim=1)
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)

        times = {"enable_gqa": [], "copied heads": []}
        for repeat in range(args.repeats + 1):
            for label, run in (("enable_gqa", in_place), ("copied heads", copied)):
                elapsed = _time_step(run, q, k, v)
                if repeat:
                    times[label].append(elapsed)
        medians = {label: statistics.median(values) for label, values in times.items()}
        rows.append({"seq": seq, "ms": medians})
        print(f"{seq:6d} {medians['enable_gqa']:12.1f} {medians['copied heads']:14.1f}", flush=True)
    return rows


def _ring_block_table(args) -> list:
    """One ring-attention block (queries against one key/value block, causal diagonal), forward + backward."""
    rows = []
    for seq in args.seq:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(args.batch, 2, HEADS // 2, seq, HEAD_DIM, generator=gen)
        k, v = (torch.randn(args.batch, 2, 1, seq, HEAD_DIM, generator=gen) for _ in range(2))
        masked = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None, None]
        dout = torch.randn_like(q)

        def explicit():
            out, lse = block_forward(q, k, v, masked, 0.125, 0.0)
            return block_backward(q, k, v, masked, 0.125, 0.0, dout, lse, (dout * out).sum(-1))

        def fused():
            out, lse = fused_block_forward(q, k, v, masked, 0.125)
            return fused_block_backward(q, k, v, masked, 0.125, dout, out, lse)

        times = {"explicit": [], "fused CPU kernel": []}
        for repeat in range(args.repeats + 1):
            for label, run in (("explicit", explicit), ("fused CPU kernel", fused)):
                start = time.perf_counter()
                run()
                if repeat:
                    times[label].append((time.perf_counter() - start) * 1e3)
        medians = {label: statistics.median(values) for label, values in times.items()}
        rows.append({"seq": seq, "ms": medians})
        print(f"{seq:6d} {medians['explicit']:10.1f} {medians['fused CPU kernel']:18.1f}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    print(
        f"core attention fwd+bwd, CPU, {args.threads} threads, batch {args.batch}, {HEADS} heads x {HEAD_DIM}, fp32: "
        "median ms (speed-up over unfused)"
    )
    print(f"{'seq':>6} {'layout':20s} " + " ".join(f"{b:>17}" for b in BACKENDS))
    backend_rows = _backend_table(args)
    print("\nSDPA grouped-query read, 8 query heads over 2 key/value heads, causal, fwd+bwd median ms")
    print(f"{'seq':>6} {'enable_gqa':>12} {'copied heads':>14}")
    gqa_rows = _gqa_table(args)
    print("\nring-attention block (CP p2p), 8 query heads over 2 key/value heads, causal diagonal, fwd+bwd median ms")
    print(f"{'block':>6} {'explicit':>10} {'fused CPU kernel':>18}")
    ring_rows = _ring_block_table(args)
    out = REPO_ROOT / "benchmarks" / "results" / "attention.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"threads": args.threads, "batch": args.batch, "heads": HEADS, "head_dim": HEAD_DIM}
    out.write_text(
        json.dumps({"settings": settings, "backends": backend_rows, "gqa": gqa_rows, "ring": ring_rows}, indent=1)
    )
    print(f"\nwrote {out.relative_to(REPO_ROOT)}")
    dist.destroy_process_group()
    Path(store.name).unlink()


if __name__ == "__main__":
    main()
