"""Bytes each rank holds between steps under DDP, the distributed optimizer and every Megatron FSDP strategy.

A GPTModel (bf16 parameters, fp32 gradients, Adam with fp32 main parameters; ``--layers`` x ``--hidden``) is trained
for ``--warmup`` + ``--iters`` steps at each data-parallel size in ``--dp`` (CPU ranks, gloo, one thread each).
After the last step every rank sums its parameters, gradients and optimizer state from the real tensors
(``megatron.core.distributed.fsdp.memory.held_bytes``: each storage once, at its current size) and the table
shows the largest rank next to the formula in bytes per parameter (p = 2, g = 4, 12 bytes of optimizer state):

    DDP                      p + g + 12            = 18
    distributed optimizer    p + g + 12/d          = 6 + 12/d
    FSDP optim               p + g + 12/d          = 6 + 12/d
    FSDP optim_grads         p + (g + 12)/d        = 2 + 16/d
    FSDP optim_grads_params  (p + g + 12)/d        = 18/d

(up to each buffer's padding to a multiple of d). Step time is the median over ``--iters`` steps, also as a
ratio to DDP's at the same DP size.

Peak memory during a step: CPU tensors have no allocator statistics, so one more step runs under
``megatron.core.distributed.fsdp.memory.PeakLiveBytes``, a TorchDispatchMode that after every operation adds up the
storages alive (the held ones at their current size, FSDP growing and freeing them in place, plus every storage the
step's operations create, until the last tensor on it is freed); the largest rank's maximum is shown.

    python benchmarks/bench_fsdp_memory.py [--dp 1 2 4 --layers 4 --hidden 256 --iters 5]

Prints a table and writes benchmarks/results/fsdp_memory.json.
"""

import argparse
import json
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.distributed.fsdp import FullyShardedDataParallel  # noqa: E402
from megatron.core.distributed.fsdp.memory import PeakLiveBytes, held_bytes, held_tensors  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

VOCAB, SEQ = 1024, 64
LAYOUTS = {
    "DDP": (None, False),
    "distributed optimizer": (None, True),
    "FSDP no_shard": ("no_shard", False),
    "FSDP optim": ("optim", True),
    "FSDP optim_grads": ("optim_grads", True),
    "FSDP optim_grads_params": ("optim_grads_params", True),
}


def formula(name: str, d: int) -> float:
    p, g, s = 2, 4, 12
    if name in ("DDP", "FSDP no_shard"):
        return p + g + s
    if name in ("distributed optimizer", "FSDP optim"):
        return p + g + s / d
    if name == "FSDP optim_grads":
        return p + (g + s) / d
    return (p + g + s) / d


def _build(args, name: str):
    strategy, distributed = LAYOUTS[name]
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    fields = dict(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
    if strategy is None:
        wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(**fields), model)
    else:
        fields.update(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
        wrapped = FullyShardedDataParallel(config, DistributedDataParallelConfig(**fields), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-4, bf16=True, use_distributed_optimizer=distributed), [wrapped]
    )
    return model, wrapped, optimizer


def _measure(args, name: str) -> dict:
    model, wrapped, optimizer = _build(args, name)
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, VOCAB, (args.micro_batch, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(args.micro_batch, SEQ)

    def train_step():
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        wrapped(tokens, positions, None, labels=tokens).float().mean().backward()
        finalize_model_grads([wrapped])
        optimizer.step()

    times = []
    for step in range(args.warmup + args.iters):
        dist.barrier()
        start = time.perf_counter()
        train_step()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    held = held_bytes([wrapped], optimizer)
    # Untimed: the dispatch mode slows every operation down.
    with PeakLiveBytes(held_tensors([wrapped], optimizer)) as peak:
        train_step()
    worst = torch.tensor(
        [held["params"], held["grads"], held["optimizer"], held["total"], peak.peak_bytes], dtype=torch.float64
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    num_params = sum(p.numel() for p in model.parameters())
    return {
        "layout": name,
        "dp": dist.get_world_size(),
        "params": num_params,
        "param_bytes": int(worst[0]),
        "grad_bytes": int(worst[1]),
        "optimizer_bytes": int(worst[2]),
        "total_bytes": int(worst[3]),
        "bytes_per_param": worst[3].item() / num_params,
        "formula": formula(name, dist.get_world_size()),
        "peak_bytes": int(worst[4]),
        "step_ms": 1000 * statistics.median(times),
    }


def _worker(rank: int, world_size: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(minutes=10)
    )
    parallel_state.initialize_model_parallel()
    rows = [_measure(args, name) for name in LAYOUTS]
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _table(rows) -> str:
    lines = [
        "| DP | layout | params MB | grads MB | optimizer MB | bytes/param | formula | held MB | peak MB | step ms "
        "| vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mb = 2**20
    ddp_ms = {row["dp"]: row["step_ms"] for row in rows if row["layout"] == "DDP"}
    for row in rows:
        lines.append(
            f"| {row['dp']} | {row['layout']} | {row['param_bytes'] / mb:.2f} | {row['grad_bytes'] / mb:.2f} | "
            f"{row['optimizer_bytes'] / mb:.2f} | {row['bytes_per_param']:.3f} | {row['formula']:.3f} | "
            f"{row['total_bytes'] / mb:.2f} | {row['peak_bytes'] / mb:.2f} | {row['step_ms']:.0f} | "
            f"{row['step_ms'] / ddp_ms[row['dp']]:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    results_dir = REPO_ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for dp in args.dp:
        out_path = results_dir / f"fsdp_memory_dp{dp}.json"
        mp.spawn(_worker, args=(dp, _free_port(), args, str(out_path)), nprocs=dp, join=True)
        rows.extend(json.loads(out_path.read_text()))
        out_path.unlink()
    (results_dir / "fsdp_memory.json").write_text(json.dumps(rows, indent=1))
    print(_table(rows))


if __name__ == "__main__":
    main()
