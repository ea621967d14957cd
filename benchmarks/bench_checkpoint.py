"""Distributed-checkpoint throughput (save/load MB/s) at DP=1 and DP=2, and the training stall of an async save.

Each data-parallel rank is a CPU process (gloo, one compute thread) holding the whole model state (``--state-mb``
of fp32 tensors, replicated over DP). Save time is wall time from a barrier before ``save`` to a barrier after it
(files fsynced, ``.metadata`` and ``metadata.json`` written), best of ``--repeats``; at DP=2 it is measured with
replica 0 writing everything and with the fully parallel wrapper spreading the writes. Save MB/s = state bytes /
time. Load time is every rank reading the whole state into preallocated tensors (typically from the page cache,
right after the save); load MB/s = bytes one rank reads / time.

The stall is measured at DP=1 on a simulated training loop (``--matmul``-sized matmuls per step): a synchronous
save blocks for its whole duration; an async save blocks while it stages (copies) the tensors, then slows the
steps that overlap the background write, then blocks for finalisation. Stall = blocking time + the extra time of
the overlapped steps over the median step time without a save; for both background workers (forked process, the
default, and thread).

    python benchmarks/bench_checkpoint.py [--state-mb 512 --repeats 2 --matmul 768]

Prints a table and writes benchmarks/results/checkpoint.json.
"""

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.core.dist_checkpointing import ShardedTensor, load, save  # noqa: E402
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper  # noqa: E402

TENSOR_COLUMNS = 4096
TENSOR_MB = 32  # 2048 x 4096 fp32 per tensor


def _state(total_mb: int, replica_id: int, fill=torch.randn):
    rows = TENSOR_MB * 2**20 // (4 * TENSOR_COLUMNS)
    return {
        f"layer{i}": ShardedTensor.from_rank_offsets(
            f"decoder.layers.{i}.weight", fill(rows, TENSOR_COLUMNS), replica_id=replica_id
        )
        for i in range(total_mb // TENSOR_MB)
    }


def _state_bytes(state) -> int:
    return sum(sh.data.numel() * sh.data.element_size() for sh in state.values())


def _fresh_dir(root: Path, name: str) -> Path:
    path = root / name
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _throughput(args, root: Path) -> list:
    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    state = _state(args.state_mb, replica_id=rank)
    target = _state(args.state_mb, replica_id=rank, fill=torch.zeros)
    megabytes = _state_bytes(state) / 2**20
    rows = []
    for fully_parallel in (False, True) if dp > 1 else (False,):
        save_times, load_times = [], []
        for repeat in range(args.repeats):
            checkpoint_dir = _fresh_dir(root, f"dp{dp}_fp{int(fully_parallel)}")
            strategy = get_default_save_sharded_strategy()
            if fully_parallel:
                strategy = FullyParallelSaveStrategyWrapper(strategy)
            save_times.append(_timed(lambda: save(state, checkpoint_dir, sharded_strategy=strategy)))
            load_times.append(_timed(lambda: load(target, checkpoint_dir, validate_access_integrity=False)))
        assert all(torch.equal(target[k].data, state[k].data) for k in state), "loaded state differs"
        rows.append(
            {
                "dp": dp,
                "fully_parallel": fully_parallel,
                "state_mb": megabytes,
                "save_s": min(save_times),
                "save_mb_s": megabytes / min(save_times),
                "load_s": min(load_times),
                "load_mb_s_per_rank": megabytes / min(load_times),
            }
        )
    return rows


def _stall(args, root: Path) -> dict:
    torch.manual_seed(0)
    state = _state(args.state_mb, replica_id=0)
    a = torch.randn(args.matmul, args.matmul)

    def step() -> float:
        start = time.perf_counter()
        for sh in list(state.values())[:1]:
            sh.data[0, : args.matmul].add_((a @ a)[0] * 1e-6)  # the "optimizer" updates the weights in place
        return time.perf_counter() - start

    baseline = statistics.median(step() for _ in range(args.baseline_steps))
    sync_dir = _fresh_dir(root, "stall_sync")
    start = time.perf_counter()
    save(state, sync_dir)
    sync_stall = time.perf_counter() - start

    result = {"state_mb": _state_bytes(state) / 2**20, "step_s": baseline, "sync_stall_s": sync_stall}
    for worker in ("process", "thread"):
        async_dir = _fresh_dir(root, f"stall_async_{worker}")
        queue = AsyncCallsQueue()
        queue.worker = worker
        start = time.perf_counter()
        queue.schedule_async_request(save(state, async_dir, async_sharded_save=True))
        staging = time.perf_counter() - start
        overlapped, finalize = [], 0.0
        while queue.get_num_unfinalized_calls():
            overlapped.append(step())
            start = time.perf_counter()
            queue.maybe_finalize_async_calls()
            finalize += time.perf_counter() - start
        slowdown = max(0.0, sum(overlapped) - baseline * len(overlapped))
        result[f"async_{worker}"] = {
            "staging_s": staging,
            "overlapped_steps": len(overlapped),
            "slowdown_s": slowdown,
            "finalize_s": finalize,
            "stall_s": staging + slowdown + finalize,
        }
    return result


def _worker(rank: int, world_size: int, port: int, args, root: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=20),
    )
    result = {"throughput": _throughput(args, Path(root))}
    if world_size == 1:
        result["stall"] = _stall(args, Path(root))
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tables(throughput, stall) -> str:
    header = (
        f"{'DP':>3} {'fully parallel':>14} {'state MB':>9} {'save s':>7} {'save MB/s':>9} {'load s':>7} "
        f"{'load MB/s/rank':>14}"
    )
    lines = [header, "-" * len(header)]
    for row in throughput:
        lines.append(
            f"{row['dp']:>3} {'yes' if row['fully_parallel'] else 'no':>14} {row['state_mb']:>9.0f} "
            f"{row['save_s']:>7.2f} {row['save_mb_s']:>9.0f} {row['load_s']:>7.2f} {row['load_mb_s_per_rank']:>14.0f}"
        )
    lines += [
        "",
        f"training stall, {stall['state_mb']:.0f} MB state, step {stall['step_s'] * 1e3:.1f} ms:",
        f"  sync save:            {stall['sync_stall_s']:.2f} s blocked",
    ]
    for worker in ("process", "thread"):
        row = stall[f"async_{worker}"]
        lines.append(
            f"  async save ({worker + ')':8} {row['stall_s']:.2f} s = staging {row['staging_s']:.2f} s + slowdown of "
            f"{row['overlapped_steps']} overlapped steps {row['slowdown_s']:.2f} s + finalize {row['finalize_s']:.2f} s"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-mb", type=int, default=512, help=f"model state size, a multiple of {TENSOR_MB}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--matmul", type=int, default=768, help="size of the square matmul of a training step")
    parser.add_argument("--baseline-steps", type=int, default=10)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary dir)")
    args = parser.parse_args()

    results_dir = REPO_ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    throughput, stall = [], None
    try:
        for dp in (1, 2):
            out_path = results_dir / f".checkpoint_dp{dp}.json"
            mp.start_processes(
                _worker, args=(dp, _free_port(), args, str(root), str(out_path)), nprocs=dp, start_method="spawn"
            )
            result = json.loads(out_path.read_text())
            out_path.unlink()
            throughput += result["throughput"]
            stall = result.get("stall", stall)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"torch {torch.__version__}; checkpoints in {root}; fp32 tensors of {TENSOR_MB} MB")
    print(_tables(throughput, stall))
    (results_dir / "checkpoint.json").write_text(
        json.dumps({"args": vars(args), "throughput": throughput, "stall": stall}, indent=2)
    )


if __name__ == "__main__":
    main()
