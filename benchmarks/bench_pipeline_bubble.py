"""Measured pipeline bubble of the 1F1B and interleaved schedules against the published formulas.

Each pipeline rank is a CPU process (gloo) running the real schedules and p2p communication. A model chunk's
forward pass costs ``t_f / v`` and its backward pass ``t_b / v`` (a rank's share of the model is cut into ``v``
chunks). A rank's bubble fraction is ``1 - busy / step time``. Two clocks measure it in the same runs:

* wall clock: each pass sleeps for its cost (so ranks do not compete for the CPU); busy is the time spent in those
  sleeps, the step runs from a common barrier to the last rank's end. This includes the machine's message latency,
  which the formula leaves out (each 1F1B micro-batch has messages on its critical path).
* logical clock: every activation and gradient carries the sender's clock in one element; a pass starts at the
  later of the rank's own clock and the clock of the tensor it consumes, and advances it by the pass's cost. This
  is the schedule's dependency structure with free communication, which is exactly what the formula describes.

The last column converts the wall-clock bubble back into step time and reports how much longer than the formula's
step it was, per micro-batch: on a busy machine that is the wake-up latency of the messages on the critical path.

Formulas (Narayanan et al. 2021, section 2.2), as fractions of the step time:

    1F1B:         (p - 1) / (m + p - 1)
    interleaved:  ((p - 1) / v) / (m + (p - 1) / v)

    python benchmarks/bench_pipeline_bubble.py [--forward-ms 50 --backward-ms 100 --repeats 3]

Prints a table and writes benchmarks/results/pipeline_bubble.json.
"""

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

PIPELINE_SIZES = (2, 4)
MICROBATCHES = (4, 8, 16)
VIRTUAL_SIZES = (1, 2)
HIDDEN = 8


class _Clocks:
    """This rank's wall-clock busy time and its logical clock (seconds)."""

    busy = 0.0
    logical = 0.0

    @classmethod
    def reset(cls) -> None:
        cls.busy = cls.logical = 0.0

    @classmethod
    def run_pass(cls, cost: float, ready_at: float) -> float:
        start = time.perf_counter()
        time.sleep(cost)
        cls.busy += time.perf_counter() - start
        cls.logical = max(cls.logical, ready_at) + cost
        return cls.logical


class _FixedCost(torch.autograd.Function):
    """Identity with a fixed forward and backward cost; element [0, 0, 0] carries the logical clock."""

    @staticmethod
    def forward(ctx, x, weight, forward_s, backward_s, last_stage):
        ctx.backward_s, ctx.last_stage = backward_s, last_stage
        out = x * weight
        out[0, 0, 0] = _Clocks.run_pass(forward_s, ready_at=float(x[0, 0, 0]))
        return out

    @staticmethod
    def backward(ctx, grad):
        # The last stage's gradient comes from its own loss: nothing to wait for.
        ready_at = 0.0 if ctx.last_stage else float(grad[0, 0, 0])
        grad = grad.clone()
        grad[0, 0, 0] = _Clocks.run_pass(ctx.backward_s, ready_at)
        return grad, torch.zeros(1, dtype=grad.dtype), None, None, None


class SleepChunk(torch.nn.Module):
    def __init__(self, config, forward_s: float, backward_s: float, last_stage: bool):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
        self.forward_s, self.backward_s, self.last_stage = forward_s, backward_s, last_stage
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0]

    def forward(self, x):
        x = x if self.input_tensor is None else self.input_tensor
        return _FixedCost.apply(x, self.weight, self.forward_s, self.backward_s, self.last_stage)


def _forward_step(data_iterator, model):
    output = model(next(data_iterator))
    return output, lambda out: (out.sum(), {"loss": out.detach().sum()})


def _endless_batches():
    while True:
        yield torch.zeros(1, 1, HIDDEN, dtype=torch.float64)  # logical clock 0: the data is there from the start


def _run_once(pp: int, vp: int, m: int, forward_s: float, backward_s: float):
    """One step on this rank; returns (busy seconds, wall start, wall end, logical end)."""
    virtual = vp if vp > 1 else None
    config = TransformerConfig(
        num_layers=pp * vp,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual,
        pipeline_dtype=torch.float64,
    )
    last_rank = parallel_state.get_pipeline_model_parallel_rank() == pp - 1
    chunks = [SleepChunk(config, forward_s / vp, backward_s / vp, last_rank and c == vp - 1) for c in range(vp)]
    schedule = get_forward_backward_func()
    _Clocks.reset()
    dist.barrier()
    start = time.time()
    schedule(
        forward_step_func=_forward_step,
        data_iterator=[_endless_batches() for _ in chunks],
        model=chunks,
        num_microbatches=m,
        seq_length=1,
        micro_batch_size=1,
    )
    return _Clocks.busy, start, time.time(), _Clocks.logical


def _worker(rank: int, pp: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp, timeout=timedelta(minutes=5)
    )
    rows = []
    for vp in VIRTUAL_SIZES:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, pp, vp if vp > 1 else None)
        _run_once(pp, vp, 2 * pp, args.forward_ms / 1e3, args.backward_ms / 1e3)  # warm-up
        for m in MICROBATCHES:
            wall, logical = [], []
            for _ in range(args.repeats):
                busy, start, end, logical_end = _run_once(pp, vp, m, args.forward_ms / 1e3, args.backward_ms / 1e3)
                everyone = [None] * pp
                dist.all_gather_object(everyone, (busy, start, end, logical_end))
                step = max(e[2] for e in everyone) - min(e[1] for e in everyone)
                wall.append([1 - e[0] / step for e in everyone])
                logical_step = max(e[3] for e in everyone)
                ideal_busy = m * (args.forward_ms + args.backward_ms) / 1e3
                logical.append([1 - ideal_busy / logical_step] * pp)
            rows.append(
                {
                    "p": pp,
                    "v": vp,
                    "m": m,
                    "wall_bubble_per_stage": [statistics.median(f) for f in zip(*wall)],
                    "logical_bubble": statistics.median(f[0] for f in logical),
                }
            )
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def formula(p: int, v: int, m: int) -> float:
    """Bubble time as a fraction of the step time (1F1B for v = 1, interleaved otherwise)."""
    bubble = (p - 1) / v
    return bubble / (m + bubble)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forward-ms", type=float, default=50.0, help="forward cost of one micro-batch per stage")
    parser.add_argument("--backward-ms", type=float, default=100.0, help="backward cost of one micro-batch per stage")
    parser.add_argument("--repeats", type=int, default=3, help="steps per configuration (the median is reported)")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = mp.get_context("spawn")
    rows = []
    for pp in PIPELINE_SIZES:
        queue = context.Queue()
        port = _free_port()
        workers = [context.Process(target=_worker, args=(r, pp, port, args, queue)) for r in range(pp)]
        for worker in workers:
            worker.start()
        rows += queue.get()
        for worker in workers:
            worker.join()
            if worker.exitcode != 0:
                raise SystemExit(f"a pipeline rank of the p={pp} run exited with code {worker.exitcode}")

    print(f"t_f = {args.forward_ms} ms, t_b = {args.backward_ms} ms per micro-batch and stage", end="")
    print(f"; median of {args.repeats} runs")
    print(
        f"{'schedule':<12} {'p':>2} {'v':>2} {'m':>3} {'formula':>8} {'logical':>8} {'rel.diff':>8} "
        f"{'wall':>7} {'worst stage':>11} {'rel.diff':>8} {'excess ms/mb':>12}"
    )
    cost = (args.forward_ms + args.backward_ms) / 1e3
    for row in rows:
        p, v, m = row["p"], row["v"], row["m"]
        expected = formula(p, v, m)
        wall = statistics.mean(row["wall_bubble_per_stage"])
        # Step time implied by the measured bubble, minus the formula's step: latency on the critical path.
        excess = m * cost / (1 - wall) - (m + (p - 1) / v) * cost
        row.update(
            formula=expected,
            logical_relative_difference=(row["logical_bubble"] - expected) / expected,
            wall_bubble_mean=wall,
            wall_relative_difference=(wall - expected) / expected,
            wall_excess_ms_per_microbatch=1e3 * excess / m,
        )
        name = "1F1B" if v == 1 else "interleaved"
        print(
            f"{name:<12} {p:>2} {v:>2} {m:>3} {expected:>8.3f} {row['logical_bubble']:>8.3f} "
            f"{row['logical_relative_difference']:>+8.1%} {wall:>7.3f} {max(row['wall_bubble_per_stage']):>11.3f} "
            f"{row['wall_relative_difference']:>+8.1%} {row['wall_excess_ms_per_microbatch']:>12.1f}"
        )
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "pipeline_bubble.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
