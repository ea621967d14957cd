"""Chaos trials: kill part of a training job at a random moment, resume it, and check nothing was lost.

Each trial starts a TP2 x PP2 job (4 CPU ranks, 2 DataLoader workers each, a checkpoint every --save-interval
iterations) through benchmarks/chaos_entry.py, which SIGKILLs at a random moment one of: a random rank, the
launcher (torchrun), or the whole job (torchrun, every rank and worker at once, as a scheduler does). The moment is
the start of the forward pass, the backward pass or the optimizer step of a random iteration, or a random delay into
a checkpoint save. Half the jobs (chosen at random) save with --async-save, so a kill during a save then hits the
rank's background saver in the middle of its write. Then it checks:

- gone: every process of the job (ranks and workers) exited within --bound-s seconds of the kill;
- intact: the tracker names a complete checkpoint (or none was written yet), and resuming from it works;
- bitwise: resumed to the end, every iteration's loss has the same float32 bits as an uninterrupted run's
  (read from TensorBoard event files, so the comparison is of the values, not of printed digits).

    python benchmarks/chaos_resume.py [--trials 20 --train-iters 8 --save-interval 2 --seed 0 --bound-s 10]

Prints a table (one row per trial, then the totals) and writes it as JSON next to --json.
"""

import argparse
import json
import random
import shutil
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, Optional, Set

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.core.dist_checkpointing.checkpoint_dir import find_checkpoint_to_load  # noqa: E402
from tests.functional_tests.configs import GOLDEN_FLAGS, with_flag  # noqa: E402
from tests.functional_tests.harness import (  # noqa: E402
    CPU_FLAGS,
    PretrainProcess,
    alive_processes,
    builtin_data_flags,
    descendants,
    kill_processes,
    run_pretrain,
)

CHAOS_ENTRY = REPO_ROOT / "benchmarks" / "chaos_entry.py"
NPROC = 4
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-workers", "2"]
TARGETS = ("rank", "launcher", "job")
PHASES = ("forward", "backward", "optimizer", "save")


def loss_bits(tensorboard_dir: Path) -> Dict[int, str]:
    """{iteration: float32 bits of the 'lm loss' scalar, as hex} from a run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {event.step: struct.pack("<f", event.value).hex() for event in accumulator.Scalars("lm loss")}


def job_flags(args, work: Path, tensorboard_dir: Path, async_save: bool = False) -> list:
    """The job of every run: same model, data and schedule; checkpoints and events under `work`. With
    ``async_save`` the checkpoints are written by each rank's background saver while training goes on."""
    flags = with_flag(GOLDEN_FLAGS, "--train-iters", str(args.train_iters))
    return (["--async-save"] if async_save else []) + (
        flags
        + CPU_FLAGS
        + builtin_data_flags(work.parent / "cache")
        + LAYOUT
        + [
            "--save",
            work / "ckpt",
            "--load",
            work / "ckpt",
            "--save-interval",
            str(args.save_interval),
            "--tensorboard-dir",
            tensorboard_dir,
            "--tensorboard-log-interval",
            "1",
        ]
    )


def _watch_tree(job: PretrainProcess, seen: Set[int], stop: threading.Event) -> None:
    while not stop.is_set():
        seen.update(descendants(job.launcher_pid))
        time.sleep(0.1)


def run_trial(args, trial: int, rng: random.Random, reference: Dict[int, str], root: Path) -> dict:
    work = root / f"trial_{trial}"
    work.mkdir()
    target, phase = rng.choice(TARGETS), rng.choice(PHASES)
    async_save = rng.random() < 0.5  # half the jobs save in the background: a kill then hits the saver mid-write
    saves = list(range(args.save_interval, args.train_iters, args.save_interval))
    iteration = rng.choice(saves) if phase == "save" else rng.randint(2, args.train_iters - 1)
    env = {
        "CHAOS_TARGET": target,
        "CHAOS_PHASE": phase,
        "CHAOS_ITERATION": str(iteration),
        "CHAOS_RANK": str(rng.randrange(NPROC)),
        "CHAOS_DELAY_S": f"{rng.uniform(0.0, 0.3):.3f}",
        "CHAOS_LOG": str(work / "killed_at"),
    }
    row = {
        "trial": trial,
        "target": f"{target} (rank {env['CHAOS_RANK']})" if target == "rank" else target,
        "moment": f"{phase} @ {iteration}" + (f" +{env['CHAOS_DELAY_S']}s" if phase == "save" else ""),
        "saves": "async" if async_save else "sync",
    }

    killed_flags = job_flags(args, work, work / "tb_killed", async_save)
    job = PretrainProcess(killed_flags, NPROC, entry_point=CHAOS_ENTRY, env=env)
    seen: Set[int] = set()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_tree, args=(job, seen, stop), daemon=True)
    watcher.start()
    try:
        killed_run = job.wait(timeout=args.timeout_s)
        ended_at = time.time()
    finally:
        stop.set()
        watcher.join()
    survivors = alive_processes(seen)
    kill_processes(survivors)
    if not (work / "killed_at").exists():
        if killed_run.returncode != 0:  # the trigger never fired, yet the job failed: a bug, not a trial
            raise RuntimeError(f"trial {trial} failed on its own\n{killed_run.describe()}")
        row.update(gone="no kill", intact="-", resumed_from="-", bitwise="-")
        return row
    gone_s = ended_at - float((work / "killed_at").read_text())
    row["gone"] = f"no ({len(survivors)} left)" if survivors or gone_s > args.bound_s else f"yes ({gone_s:.1f} s)"

    try:
        found = find_checkpoint_to_load(work / "ckpt")
        resumed_from = 0 if found is None else found[1]
        intact = True
    except CheckpointingException as error:
        resumed_from, intact = None, False
        row["error"] = str(error)
    resumed = run_pretrain(
        job_flags(args, work, work / "tb_resumed", async_save), NPROC, expect_success=False, timeout=args.timeout_s
    )
    intact = intact and resumed.returncode == 0
    row["intact"] = "yes" if intact else "NO"
    row["resumed_from"] = resumed_from
    compared = loss_bits(work / "tb_resumed") if intact else {}
    expected = {i: bits for i, bits in reference.items() if resumed_from is not None and i > resumed_from}
    row["bitwise"] = f"yes ({len(expected)} iters)" if compared == expected and expected else "NO"
    shutil.rmtree(work, ignore_errors=True)
    return row


def print_table(rows) -> None:
    columns = ["trial", "target", "moment", "saves", "gone", "intact", "resumed_from", "bitwise"]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-|-".join("-" * widths[c] for c in columns))
    for row in rows:
        print(" | ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns))


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--train-iters", type=int, default=8)
    parser.add_argument("--save-interval", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound-s", type=float, default=10.0, help="every process must be gone this soon")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--json", default="chaos_resume.json")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    root = Path(tempfile.mkdtemp(prefix="chaos_"))
    try:
        reference_dir = root / "reference"
        reference_dir.mkdir()
        run_pretrain(job_flags(args, reference_dir, reference_dir / "tb"), NPROC, timeout=args.timeout_s)
        reference = loss_bits(reference_dir / "tb")
        rows = []
        for trial in range(1, args.trials + 1):
            rows.append(run_trial(args, trial, rng, reference, root))
            print(f"trial {trial}: {rows[-1]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print()
    print_table(rows)
    killed = [r for r in rows if r["gone"] != "no kill"]
    totals = {
        "trials": len(rows),
        "killed": len(killed),
        "all gone within bound": sum(r["gone"].startswith("yes") for r in killed),
        "checkpoints intact": sum(r["intact"] == "yes" for r in killed),
        "resumed loss bitwise equal": sum(r["bitwise"].startswith("yes") for r in killed),
    }
    print("\n" + ", ".join(f"{k}: {v}" for k, v in totals.items()))
    Path(args.json).write_text(json.dumps({"rows": rows, "totals": totals, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
