"""Tensor-parallel communication overlap (``--tp-comm-overlap``) at TP2 + sequence parallelism on CPU gloo ranks.

A GPT (local spec, fp32, no dropout) runs forward + backward on two ranks in three settings, interleaved within each
repeat so load from other processes falls on all of them alike:

- ``blocking``: every tensor-parallel collective of the transformer linears waits at once (tp_comm_overlap with the
  pipelining and bulk overlaps all off): all their communication is exposed;
- ``plain``: the default path (tp_comm_overlap off), whose column-parallel backward already overlaps the input
  re-gather with the input-gradient GEMM and the gradient reduce-scatter with the weight-gradient GEMM;
- ``overlap``: ``tp_comm_overlap=True`` (chunked all-gather -> GEMM and GEMM -> reduce-scatter, bulk overlaps).

Every collective is issued asynchronously and timed from ``wait()`` call to return: the time the compute thread
sits blocked on communication (exposed communication; the larger of the two ranks). The share hidden is
``1 - exposed / exposed(blocking)``, from the medians and from the minima over the repeats.

    python benchmarks/bench_tp_overlap.py [--layers 2 --hidden 256 --seq 2048 --steps 3 --repeats 5]

Prints a table (median step time, median exposed communication per step) and writes
benchmarks/results/tp_overlap.json.
"""

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results" / "tp_overlap.json"
SETTINGS = {
    "blocking": {
        "tp_comm_overlap": True,
        "tp_comm_overlap_ag": False,
        "tp_comm_overlap_rs": False,
        "tp_comm_bulk_wgrad": False,
        "tp_comm_bulk_dgrad": False,
    },
    "plain": {},
    "overlap": {"tp_comm_overlap": True},
}


class _TimedWork:
    def __init__(self, work, clock):
        self.work, self.clock = work, clock

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        result = self.work.wait(*args, **kwargs)
        self.clock[0] += time.perf_counter() - start
        return result

    def __getattr__(self, name):
        return getattr(self.work, name)


def _time_collectives(clock):
    """Route every collective the TP layers use through an async call whose wait() is timed."""
    from megatron.core.tensor_parallel import comm_overlap, mappings, utils

    def timed(collective):
        def run(*args, async_op=False, **kwargs):
            work = _TimedWork(collective(*args, async_op=True, **kwargs), clock)
            if async_op:
                return work
            work.wait()
            return None

        return run

    for name in ("all_gather", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        setattr(dist, name, timed(getattr(dist, name)))
    for module in (utils, mappings, comm_overlap):
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            if hasattr(module, name):
                setattr(module, name, timed(getattr(module, name)))


def _rank(rank, port, options, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1)
    clock = [0.0]
    _time_collectives(clock)
    models = {}
    for name, overrides in SETTINGS.items():
        config = TransformerConfig(
            num_layers=options.layers,
            hidden_size=options.hidden,
            num_attention_heads=8,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            use_cpu_initialization=True,
            **overrides,
        )
        models[name] = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=1024, max_sequence_length=options.seq)
    tokens = torch.randint(0, 1024, (1, options.seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(options.seq).unsqueeze(0)

    def step(model):
        model(tokens, positions, None, labels=tokens).sum().backward()

    times = {name: [] for name in SETTINGS}
    exposed = {name: [] for name in SETTINGS}
    for model in models.values():
        step(model)  # warm-up
    for _ in range(options.repeats):
        for name, model in models.items():
            dist.barrier()
            clock[0] = 0.0
            start = time.perf_counter()
            for _ in range(options.steps):
                step(model)
            times[name].append((time.perf_counter() - start) / options.steps)
            exposed[name].append(clock[0] / options.steps)
    queue.put((rank, times, exposed))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    workers = [context.Process(target=_rank, args=(rank, port, options, queue)) for rank in range(2)]
    for worker in workers:
        worker.start()
    results = {rank: (times, exposed) for rank, times, exposed in (queue.get() for _ in workers)}
    for worker in workers:
        worker.join()
    times, exposed = (
        results[0][0],
        {name: [max(a, b) for a, b in zip(results[0][1][name], results[1][1][name])] for name in SETTINGS},
    )
    rows = []
    print(f"TP2 + SP, {options.layers} layers, hidden {options.hidden}, seq {options.seq}, fp32, 1 thread per rank")
    print(f"{'setting':<10} {'step median (s)':>16} {'step min (s)':>13} {'exposed comm median / min (s)':>30}")
    for name in SETTINGS:
        rows.append(
            {
                "setting": name,
                "step_median_s": statistics.median(times[name]),
                "step_min_s": min(times[name]),
                "exposed_comm_median_s": statistics.median(exposed[name]),
                "exposed_comm_min_s": min(exposed[name]),
            }
        )
        row = rows[-1]
        waits = f"{row['exposed_comm_median_s']:.3f} / {row['exposed_comm_min_s']:.3f}"
        print(f"{name:<10} {row['step_median_s']:>16.3f} {row['step_min_s']:>13.3f} {waits:>30}")
    for statistic in ("median", "min"):
        blocking = rows[0][f"exposed_comm_{statistic}_s"]
        shares = ", ".join(
            f"{row['setting']} {1 - row[f'exposed_comm_{statistic}_s'] / blocking:.0%}" for row in rows[1:]
        )
        print(f"communication hidden vs blocking ({statistic}s): {shares}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"options": vars(options), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
