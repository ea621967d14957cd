"""Context-parallel attention: forward+backward time, bytes sent per rank and activation memory per rank.

Each CP rank is a CPU process (gloo, one thread) running ``ContextParallelAttention`` on its load-balanced part of a
causal sequence (grouped-query attention, small heads: b=1, 4 query heads, 2 key/value heads, d=32, fp32). For
every CP size and sequence length it reports:

* forward+backward wall time (median of the repeats, the slowest rank), and for CP=1 the same for PyTorch's SDPA,
  which is what ``DotProductAttention`` runs without CP;
* bytes each rank sent, counted at the ring's ``isend`` calls, against the formula: the forward makes ``CP-1`` ring
  steps, each sending ``2 x (s/CP) x b x n_kv x d`` elements; the backward sends the blocks again (``CP-1``) plus
  their gradients (``CP`` transfers of the same size);
* activation memory per rank: bytes the attention keeps for backward, measured with saved-tensor hooks, against
  the formula for ``s/CP`` tokens: queries, keys, values and output, ``(s/CP) b d (2 n + 2 n_kv)``, plus the
  log-sum-exp, ``(s/CP) b n`` elements (the K/V blocks in flight are temporaries, not kept).

    python benchmarks/bench_context_parallel.py [--seqs 1024 2048 4096 8192] [--cps 1 2 4] [--repeats 2]
        [--max-tokens-per-rank 8192]

A (CP, s) pair whose ``s/CP`` exceeds ``--max-tokens-per-rank`` is skipped: on the 2-core development machine one
rank's 16k-token causal block pass takes minutes. Prints a table and writes benchmarks/results/context_parallel.json.
"""

import argparse
import importlib
import json
import math
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.context_parallel import ContextParallelAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.context_parallel.batch import chunks_of_cp_rank

# The package re-exports the function ring_attention under the module's name, so fetch the module itself.
ring_module = importlib.import_module("megatron.core.transformer.context_parallel.ring_attention")

BATCH, HEADS, KV_HEADS, HEAD_DIM = 1, 4, 2, 32
BYTES_PER_ELEMENT = 4  # fp32


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _SentBytes:
    """Counts what the ring sends (wraps the one place it calls isend)."""

    def __init__(self):
        self.total = 0
        self._start = ring_module._Ring.start

        def counting_start(ring, send):
            self.total += send.numel() * send.element_size()
            return self._start(ring, send)

        ring_module._Ring.start = counting_start


def _saved_bytes(function):
    """Run ``function`` and return (its result, bytes of the tensors autograd saved for backward)."""
    seen = {}

    def pack(tensor):
        seen[(tensor.data_ptr(), tensor.numel(), tensor.dtype)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = function()
    return result, sum(seen.values())


def _inputs(seq: int, cp: int, rank: int):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(seq, BATCH, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(seq, BATCH, KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(seq, BATCH, KV_HEADS, HEAD_DIM, generator=generator)
    return [chunks_of_cp_rank(t, 0, cp, rank).requires_grad_() for t in (q, k, v)]


def _time_sdpa(seq: int, repeats: int) -> float:
    q, k, v = _inputs(seq, 1, 0)

    def step():
        qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)))
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).sum().backward()

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank, cp, port, seqs, repeats, max_tokens, queue):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp, timeout=timedelta(minutes=30)
    )
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    group = parallel_state.get_context_parallel_group()
    attention = ContextParallelAttention("p2p", group, AttnMaskType.causal, 1 / math.sqrt(HEAD_DIM), HEADS, KV_HEADS)
    counter = _SentBytes()
    rows = []
    for seq in seqs:
        if seq // cp > max_tokens:
            continue
        q, k, v = _inputs(seq, cp, rank)
        times, sent_forward, sent_backward, saved = [], 0, 0, 0
        for repeat in range(repeats + 1):  # the first run warms up
            dist.barrier(group)
            start = time.perf_counter()
            counter.total = 0
            out, saved = _saved_bytes(lambda: attention(q, k, v, None, None, 0.0, False))
            sent_forward = counter.total
            out.sum().backward()
            sent_backward = counter.total - sent_forward
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if repeat:
                times.append(elapsed.item())
        block = 2 * (seq // cp) * BATCH * KV_HEADS * HEAD_DIM * BYTES_PER_ELEMENT
        row = {
            "cp": cp,
            "seq": seq,
            "seconds": statistics.median(times),
            "sent_forward": sent_forward,
            "formula_forward": (cp - 1) * block,
            "sent_backward": sent_backward,
            "formula_backward": (2 * cp - 1) * block if cp > 1 else 0,
            "saved_bytes": saved,
            "formula_saved": (seq // cp) * BATCH * (HEAD_DIM * (2 * HEADS + 2 * KV_HEADS) + HEADS) * BYTES_PER_ELEMENT,
        }
        if cp == 1:
            row["sdpa_seconds"] = _time_sdpa(seq, repeats)
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run(cp, seqs, repeats, max_tokens):
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(rank, cp, port, seqs, repeats, max_tokens, queue)) for rank in range(cp)
    ]
    for process in processes:
        process.start()
    rows = queue.get()
    for process in processes:
        process.join()
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens-per-rank", type=int, default=8192)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rows = []
    for cp in args.cps:
        rows += run(cp, args.seqs, args.repeats, args.max_tokens_per_rank)
    header = (
        "| CP | seq | fwd+bwd s (ring) | SDPA s | sent fwd MiB (formula) | sent bwd MiB (formula) | "
        "saved for bwd MiB (formula) |"
    )
    print(header)
    print("|---" * 7 + "|")
    for row in sorted(rows, key=lambda r: (r["seq"], r["cp"])):
        sdpa = f"{row['sdpa_seconds']:.3f}" if "sdpa_seconds" in row else "-"
        print(
            f"| {row['cp']} | {row['seq']} | {row['seconds']:.3f} | {sdpa} | "
            f"{_mib(row['sent_forward'])} ({_mib(row['formula_forward'])}) | "
            f"{_mib(row['sent_backward'])} ({_mib(row['formula_backward'])}) | "
            f"{_mib(row['saved_bytes'])} ({_mib(row['formula_saved'])}) |"
        )
    out = Path(__file__).parent / "results" / "context_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
