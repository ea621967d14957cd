"""Model-state bytes per rank and optimizer step time for DP in {1, 2, 4}, with and without the distributed optimizer.

Each data-parallel rank is a CPU process (gloo, one thread). The model is a stack of square Linear layers run in
bf16 (Float16Module) with an fp32 gradient buffer and Adam, the setting of the published accounting:

    bytes per parameter per rank = 2 (bf16 param) + 4 (fp32 grad) + 12 (fp32 main param + Adam m, v)
                                 = 18 without the distributed optimizer, 6 + 12/d with it (ZeRO-1).

Bytes are counted from the tensors that exist after a step (buffers, owned main params, per-element optimizer
state). Step time is forward + backward over the micro-batches + finalize_model_grads + optimizer.step, median over
the timed iterations, the slowest rank; with and without ``overlap_grad_reduce`` (several buckets).

    python benchmarks/bench_optimizer.py [--layers 8 --width 512 --micro-batch 8 --microbatches 2 --iters 10]

Prints a table and writes benchmarks/results/optimizer.json.
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
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

DP_SIZES = (1, 2, 4)


def _build(args, distributed: bool, overlap: bool):
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.width, num_attention_heads=1, bf16=True)
    module = Float16Module(config, torch.nn.Sequential(*layers))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=distributed,
        overlap_grad_reduce=overlap,
        bucket_size=args.bucket_size if overlap else None,
    )
    model = DistributedDataParallel(config, ddp_config, module)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-4, bf16=True, use_distributed_optimizer=distributed), [model]
    )
    return model, optimizer


def _step(model, optimizer, inputs) -> None:
    model.zero_grad_buffer()
    optimizer.zero_grad()
    for index, batch in enumerate(inputs):
        if index < len(inputs) - 1:
            with model.no_sync():
                model(batch).pow(2).mean().backward()
        else:
            model(batch).pow(2).mean().backward()
    finalize_model_grads([model])
    optimizer.step()


def _measure(args, distributed: bool, overlap: bool) -> dict:
    model, optimizer = _build(args, distributed, overlap)
    num_params = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs = [torch.randn(args.micro_batch, args.width, generator=generator) for _ in range(args.microbatches)]
    for _ in range(args.warmup):
        _step(model, optimizer, inputs)
    times = []
    for _ in range(args.iters):
        dist.barrier()
        start = time.perf_counter()
        _step(model, optimizer, inputs)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())

    if distributed:
        param_bytes = sum(b.param_data.numel() * b.param_data.element_size() for b in model.buffers)
    else:
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers)
    state = torch.tensor([param_bytes, grad_bytes, optimizer.state_bytes()], dtype=torch.float64)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)  # the most loaded rank
    return {
        "params": num_params,
        "param_bytes": int(state[0]),
        "grad_bytes": int(state[1]),
        "optimizer_state_bytes": int(state[2]),
        "buckets": sum(len(b.buckets) for b in model.buffers),
        "step_ms": 1000 * statistics.median(times),
    }


def _worker(rank: int, world_size: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=10),
    )
    parallel_state.initialize_model_parallel()
    rows = []
    for distributed in (False, True):
        for overlap in (False, True):
            rows.append(
                {
                    "dp": world_size,
                    "distributed_optimizer": distributed,
                    "overlap_grad_reduce": overlap,
                    **_measure(args, distributed, overlap),
                }
            )
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _table(rows) -> str:
    header = (
        f"{'DP':>3} {'dist-opt':>8} {'opt state MB/rank':>17} {'bytes/param':>11} {'formula':>8} "
        f"{'step ms':>8} {'step ms overlap':>15} {'buckets':>7}"
    )
    lines = [header, "-" * len(header)]
    by_key = {(r["dp"], r["distributed_optimizer"], r["overlap_grad_reduce"]): r for r in rows}
    for dp in sorted({r["dp"] for r in rows}):
        for distributed in (False, True):
            plain, overlapped = by_key[(dp, distributed, False)], by_key[(dp, distributed, True)]
            total = plain["param_bytes"] + plain["grad_bytes"] + plain["optimizer_state_bytes"]
            formula = 6 + 12 / dp if distributed else 18
            lines.append(
                f"{dp:>3} {'yes' if distributed else 'no':>8} {plain['optimizer_state_bytes'] / 2**20:>17.2f} "
                f"{total / plain['params']:>11.3f} {formula:>8.3f} {plain['step_ms']:>8.1f} "
                f"{overlapped['step_ms']:>15.1f} {overlapped['buckets']:>7}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--bucket-size", type=int, default=500_000, help="elements per bucket with overlap")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()

    results_dir = REPO_ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for dp in DP_SIZES:
        out_path = results_dir / f".optimizer_dp{dp}.json"
        mp.start_processes(_worker, args=(dp, _free_port(), args, str(out_path)), nprocs=dp, start_method="spawn")
        rows += json.loads(out_path.read_text())
        out_path.unlink()
    params = rows[0]["params"]
    print(
        f"bf16 model, fp32 grads, Adam: {params:,} parameters; torch {torch.__version__}; "
        f"{args.microbatches} micro-batches of {args.micro_batch}"
    )
    print(_table(rows))
    (results_dir / "optimizer.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
