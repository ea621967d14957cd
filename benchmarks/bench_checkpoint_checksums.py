"""The cost of checkpoint checksums: save and load of a ~1 GB checkpoint with and without them, side by side.

One process writes ``--state-mb`` of fp32 tensors (``--tensor-mb`` each, plus a few small ones) as a ``torch_dist``
checkpoint and as a legacy ``torch`` file, then loads them into preallocated tensors. "with" is the default
(checksummed while written, verified while read); "without" writes through DCP's plain file system (no records) and
loads with verification off. Runs alternate (with, without, without, with, ...) so both see the same page cache
and disk; the table gives the best of ``--repeats`` (this is a shared machine) and the overhead. Save times include
the fsync of every file. Each checkpoint is loaded twice: from the page cache, right after the save, where
checksums weigh most, and from disk, as a resume in a new job reads it (its pages are dropped from the cache first
with ``posix_fadvise(DONTNEED)``, which needs no privileges once the files are fsynced).

    python benchmarks/bench_checkpoint_checksums.py [--state-mb 1024 --tensor-mb 64 --repeats 5]

Prints a table and writes benchmarks/results/checkpoint_checksums.json.
"""

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from torch.distributed.checkpoint.filesystem import FileSystem  # noqa: E402

from megatron.core.dist_checkpointing import ShardedTensor, load, save  # noqa: E402
from megatron.core.dist_checkpointing import checksums  # noqa: E402
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy  # noqa: E402


def _state(total_mb: int, tensor_mb: int, fill) -> dict:
    numel = tensor_mb * (1 << 20) // 4
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", fill(numel)) for i in range(total_mb // tensor_mb)}
    for i in range(8):  # norms, biases: small tensors among the large ones
        state[f"small{i}"] = ShardedTensor.from_rank_offsets(f"small{i}", fill(1024))
    return state


@contextmanager
def _checksums(enabled: bool):
    """With ``enabled`` False: DCP's plain file system for writing (no records) and no verification on reading."""
    original = torch_strategy.ChecksummingFileSystem
    if not enabled:
        torch_strategy.ChecksummingFileSystem = lambda root: FileSystem()
    try:
        with checksums.verification(enabled):
            yield
    finally:
        torch_strategy.ChecksummingFileSystem = original


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fresh(directory: Path) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def _drop_from_page_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def _torch_dist_round(root: Path, state: dict, targets: dict, enabled: bool) -> tuple:
    directory = _fresh(root / "torch_dist")
    with _checksums(enabled):
        saved = _timed(lambda: save(state, str(directory)))
        loaded = _timed(lambda: load(targets, str(directory)))
        _drop_from_page_cache(directory)
        loaded_from_disk = _timed(lambda: load(targets, str(directory)))
    return saved, loaded, loaded_from_disk


def _legacy_round(root: Path, plain: dict, enabled: bool) -> tuple:
    directory = _fresh(root / "legacy" / "mp_rank_00")
    path = directory / "model_optim_rng.pt"

    def write():
        if enabled:
            with checksums.capture_records() as records:
                checksums.torch_save(plain, f"{path}.tmp")
            checksums.write_record(directory.parent, "mp_rank_00/model_optim_rng.pt", records[f"{path}.tmp"])
        else:
            with open(f"{path}.tmp", "wb") as file:
                torch.save(plain, file)
                file.flush()
                os.fsync(file.fileno())
        os.replace(f"{path}.tmp", path)

    def read():
        with checksums.verification(enabled):
            checksums.safe_torch_load_verified(str(path), "benchmark")

    saved, loaded = _timed(write), _timed(read)
    _drop_from_page_cache(directory.parent)
    return saved, loaded, _timed(read)


def _row(name: str, with_times, without_times) -> dict:
    with_s, without_s = min(with_times), min(without_times)
    return {"what": name, "without_s": without_s, "with_s": with_s, "overhead_pct": 100 * (with_s / without_s - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-mb", type=int, default=1024)
    parser.add_argument("--tensor-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = _state(args.state_mb, args.tensor_mb, lambda n: torch.randn(n))
    targets = _state(args.state_mb, args.tensor_mb, torch.zeros)
    plain = {key: shard.data for key, shard in state.items()}
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checksums_"))
    keys = ("dist_save", "dist_load", "dist_load_disk", "legacy_save", "legacy_load", "legacy_load_disk")
    times = {key: {True: [], False: []} for key in keys}
    try:
        for repeat in range(args.repeats):
            # Alternating which goes first, so neither always follows the other's deletes and writes.
            for enabled in (True, False) if repeat % 2 == 0 else (False, True):
                for prefix, round_times in (
                    ("dist", _torch_dist_round(root, state, targets, enabled)),
                    ("legacy", _legacy_round(root, plain, enabled)),
                ):
                    for suffix, seconds in zip(("_save", "_load", "_load_disk"), round_times):
                        times[prefix + suffix][enabled].append(seconds)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    names = {
        "dist_save": "torch_dist save",
        "dist_load": "torch_dist load",
        "dist_load_disk": "  from disk",
        "legacy_save": "torch (legacy) save",
        "legacy_load": "torch (legacy) load",
        "legacy_load_disk": "  from disk",
    }
    rows = [_row(names[key], value[True], value[False]) for key, value in times.items()]
    print(
        f"checkpoint of {args.state_mb} MB, best of {args.repeats} runs each; checksums: {checksums.DEFAULT_ALGORITHM}"
    )
    print(f"{'':22} {'without (s)':>12} {'with (s)':>10} {'overhead':>9}")
    for row in rows:
        print(f"{row['what']:22} {row['without_s']:12.3f} {row['with_s']:10.3f} {row['overhead_pct']:8.1f}%")
    result = {
        "state_mb": args.state_mb,
        "tensor_mb": args.tensor_mb,
        "repeats": args.repeats,
        "algorithm": checksums.DEFAULT_ALGORITHM,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "rows": rows,
    }
    out = REPO_ROOT / "benchmarks" / "results" / "checkpoint_checksums.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
