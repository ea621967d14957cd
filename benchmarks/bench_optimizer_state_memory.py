"""Optimizer-state bytes per rank: fp32 state vs the precision-aware optimizer's 16-bit state vs CPU offload.

Each data-parallel rank is a CPU process (gloo, one thread). The model is a stack of square Linear layers run in
bf16 (Float16Module) with Adam and the distributed optimizer (which the precision-aware optimizer requires), the
gradient buffer in fp32 unless a row says bf16. Per parameter, with d data-parallel ranks, the optimizer holds:

    fp32 state (main param + m + v)             4 + 4 + 4 = 12/d bytes
    bf16 moments                                4 + 2 + 2 =  8/d
    fp16 main params + bf16 moments             2 + 2 + 2 =  6/d
    offload fraction f (HybridDeviceOptimizer)  device: 4 + 8 (1 - f), host: (4 + 4 + 8) f   (per d)
    bf16 moments, offload 1.0                   device: 4,                host: 4 + 4 + 4     (per d)

(the offloaded part keeps a host copy of its main param and a host gradient buffer next to its moments; the device
keeps the main param shard itself). Bytes are summed from the tensors that exist after a step; "host" counts the
HybridDeviceOptimizer's host buffers and state (on a CPU-only machine both sides are host memory, so the split is
the one a GPU run would have). Step time: forward + backward + step, median over the timed iterations, slowest rank.

    python benchmarks/bench_optimizer_state_memory.py [--layers 8 --width 512 --iters 5]

Prints a table and writes benchmarks/results/optimizer_state_memory.json.
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
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

DP_SIZES = (1, 2)
BF16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
# (name, OptimizerConfig fields, fp32 gradient buffer, device and host bytes per parameter before dividing by d)
VARIANTS = (
    ("fp32 state", {}, True, (12, 0)),
    ("bf16 moments", dict(use_precision_aware_optimizer=True, **BF16), True, (8, 0)),
    (
        "bf16 moments + bf16 grads",
        dict(use_precision_aware_optimizer=True, main_grads_dtype=torch.bfloat16, **BF16),
        False,
        (8, 0),
    ),
    (
        "fp16 main + bf16 moments",
        dict(use_precision_aware_optimizer=True, main_params_dtype=torch.float16, **BF16),
        True,
        (6, 0),
    ),
    ("offload 0.5", dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5), True, (8, 8)),
    ("offload 1.0", dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0), True, (4, 16)),
    (
        "bf16 moments + offload 1.0",
        dict(use_precision_aware_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, **BF16),
        True,
        (4, 12),
    ),
)


def _build(args, fields: dict, fp32_grads: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)]
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.width, num_attention_heads=1, bf16=True)
    module = Float16Module(config, torch.nn.Sequential(*layers))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=fp32_grads, use_distributed_optimizer=True)
    model = DistributedDataParallel(config, ddp_config, module)
    optimizer_config = OptimizerConfig(lr=1e-4, bf16=True, use_distributed_optimizer=True, **fields)
    return model, get_megatron_optimizer(optimizer_config, [model])


def _state_bytes(optimizer) -> tuple:
    """(device bytes, host bytes) the optimizer holds."""
    total = optimizer.state_bytes()
    hybrid = optimizer.optimizer
    if not isinstance(hybrid, HybridDeviceOptimizer):
        return total, 0
    host_state = 0
    for param, _, _ in hybrid.offloaded:
        host_state += sum(v.numel() * v.element_size() for v in hybrid.state[param].values() if v.dim() > 0)
    return total - host_state, hybrid.host_state_bytes()


def _measure(args, fields: dict, fp32_grads: bool) -> dict:
    model, optimizer = _build(args, fields, fp32_grads)
    num_params = sum(p.numel() for p in model.parameters())
    inputs = torch.randn(args.micro_batch, args.width, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for iteration in range(args.warmup + args.iters):
        dist.barrier()
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(inputs).float().pow(2).mean().backward()
        model.finish_grad_sync()
        optimizer.step()
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if iteration >= args.warmup:
            times.append(elapsed.item())
    device, host = _state_bytes(optimizer)
    measured = torch.tensor([device, host], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)  # the most loaded rank
    return {
        "params": num_params,
        "device_bytes": int(measured[0]),
        "host_bytes": int(measured[1]),
        "step_ms": 1000 * statistics.median(times),
    }


def _worker(rank: int, world_size: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(minutes=10)
    )
    parallel_state.initialize_model_parallel()
    rows = [
        {"dp": world_size, "variant": name, "formula": formula, **_measure(args, fields, fp32_grads)}
        for name, fields, fp32_grads, formula in VARIANTS
    ]
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _table(rows) -> str:
    header = (
        f"{'DP':>3} {'variant':<27} {'device MB/rank':>14} {'host MB/rank':>12} {'device B/param':>14} "
        f"{'host B/param':>12} {'formula':>9} {'step ms':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        dp, params = row["dp"], row["params"]
        formula = f"{row['formula'][0] / dp:g}/{row['formula'][1] / dp:g}"
        lines.append(
            f"{dp:>3} {row['variant']:<27} {row['device_bytes'] / 2**20:>14.2f} {row['host_bytes'] / 2**20:>12.2f} "
            f"{row['device_bytes'] / params:>14.3f} {row['host_bytes'] / params:>12.3f} {formula:>9} "
            f"{row['step_ms']:>8.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    results_dir = REPO_ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for dp in DP_SIZES:
        out_path = results_dir / f".optimizer_state_memory_dp{dp}.json"
        mp.start_processes(_worker, args=(dp, _free_port(), args, str(out_path)), nprocs=dp, start_method="spawn")
        rows += json.loads(out_path.read_text())
        out_path.unlink()
    print(f"bf16 model, Adam, distributed optimizer: {rows[0]['params']:,} parameters; torch {torch.__version__}")
    print("formula: device/host optimizer bytes per parameter on each rank")
    print(_table(rows))
    (results_dir / "optimizer_state_memory.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
