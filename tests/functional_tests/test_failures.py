"""A job that fails, fails fast and says why once: no hang on an exception, no rank outliving a killed torchrun,
one report of an error however many ranks hit it."""

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Dict, Set

import pytest

from tests.functional_tests.configs import GOLDEN_FLAGS, with_flag
from tests.functional_tests.harness import (
    PretrainProcess,
    alive_processes,
    descendants,
    kill_processes,
    run_pretrain,
)

FAIL_AT_ITERATION = Path(__file__).parent / "entry_points" / "fail_at_iteration.py"
# After torchrun is killed, its ranks (and their DataLoader workers) must be gone within this many seconds.
LAUNCHER_DEATH_BOUND_S = 10.0

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")


def _run_failing(flags, nproc, tmp_path, fail_with="crash"):
    """Run with one rank raising at iteration 2; returns the result and the seconds from the raise to the job's end."""
    failed_at = tmp_path / "failed_at"
    env = {"FAIL_AT_ITERATION": "2", "FAIL_WITH": fail_with, "FAIL_LOG": str(failed_at)}
    result = run_pretrain(
        flags + ["--num-workers", "2"],
        nproc=nproc,
        expect_success=False,
        timeout=120,
        entry_point=FAIL_AT_ITERATION,
        env=env,
    )
    assert failed_at.exists(), f"the job ended before the injected failure\n{result.describe()}"
    return result, time.time() - float(failed_at.read_text())


@pytest.mark.parametrize("nproc, layout", [(1, []), (4, ["--tensor-model-parallel-size", "2"])])
def test_an_exception_during_training_ends_the_job_with_its_message_once(cpu_data_flags, nproc, layout, tmp_path):
    """With DataLoader workers (which ignore SIGTERM) an exception used to leave the rank joining them forever."""
    result, ended_after = _run_failing(GOLDEN_FLAGS + cpu_data_flags + layout, nproc, tmp_path)
    assert result.returncode != 0, result.describe()
    assert ended_after < 30, f"the job ended {ended_after:.0f} s after the exception\n{result.describe()}"
    assert [r["iteration"] for r in result.records] == [1], result.describe()
    assert result.output.count("RuntimeError: injected failure at iteration 2") == 1, result.describe()
    assert result.output.count("crashed:\nTraceback") == 1, result.describe()


def test_an_input_error_is_one_short_block_starting_with_the_message(cpu_data_flags, tmp_path):
    result, _ = _run_failing(GOLDEN_FLAGS + cpu_data_flags, 1, tmp_path, fail_with="input")
    assert result.returncode != 0, result.describe()
    lines = result.output.splitlines()
    first = next(i for i, line in enumerate(lines) if "injected failure" in line)
    assert lines[first].endswith("error: injected failure at iteration 2"), result.describe()
    assert "MEGATRON_LITE_VERBOSE_ERRORS=1" in lines[first + 1], result.describe()
    assert "Traceback" not in "\n".join(lines[first - 3 : first + 3]), result.describe()
    assert result.output.count("injected failure") == 1, result.describe()


def test_a_configuration_error_on_four_ranks_prints_once_and_no_argument_dump(cpu_data_flags):
    flags = with_flag(GOLDEN_FLAGS, "--global-batch-size", "10") + cpu_data_flags
    result = run_pretrain(flags, nproc=4, expect_success=False, timeout=120)
    assert result.returncode != 0, result.describe()
    message = "--global-batch-size (10) must be a multiple of --micro-batch-size (4) x data-parallel size (4)"
    assert result.output.count(message) == 1, result.describe()
    assert "Traceback" not in result.output.split(message)[0], result.describe()
    assert "------------------------ arguments" not in result.output, result.describe()


def test_verbose_errors_give_every_rank_its_traceback(cpu_data_flags):
    flags = with_flag(GOLDEN_FLAGS, "--global-batch-size", "10") + cpu_data_flags
    result = run_pretrain(flags, nproc=2, expect_success=False, timeout=120, env={"MEGATRON_LITE_VERBOSE_ERRORS": "1"})
    assert result.returncode != 0, result.describe()
    # Both ranks fail the same check, but torchrun SIGTERMs the others as soon as the first one exits: each rank
    # printed its own traceback (the once-per-error deduplication is off) unless it was stopped before the check.
    printed = [rank for rank in (0, 1) if result.output.count(f"rank {rank} crashed:\nTraceback") == 1]
    assert printed, result.describe()
    assert len(printed) == 2 or "exitcode  : -15" in result.output, result.describe()


@linux_only
def test_killing_torchrun_takes_every_rank_down_and_nothing_is_written_after(cpu_data_flags, tmp_path):
    save_dir = tmp_path / "checkpoints"
    flags = (
        with_flag(GOLDEN_FLAGS, "--train-iters", "100000")
        + cpu_data_flags
        + [
            "--tensor-model-parallel-size",
            "2",
            "--num-workers",
            "2",
            "--eval-iters",
            "0",
            "--save",
            save_dir,
            "--save-interval",
            "2",
        ]
    )
    job = PretrainProcess(flags, nproc=4)
    processes: Set[int] = set()
    try:
        job.wait_for_line(lambda line: "successfully saved checkpoint from iteration       4" in line, timeout=120)
        processes = descendants(job.launcher_pid)
        assert len(processes) >= 4 + 4 * 2, f"expected 4 ranks with 2 workers each, found {sorted(processes)}"
        os.kill(job.launcher_pid, signal.SIGKILL)  # torchrun only, as a cancelled step or a closed terminal does
        killed_at = time.time()
        deadline = time.monotonic() + LAUNCHER_DEATH_BOUND_S
        while alive_processes(processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = alive_processes(processes)
        assert not survivors, f"{len(survivors)} processes outlived torchrun by {LAUNCHER_DEATH_BOUND_S} s"
        written_after = [path for path in save_dir.rglob("*") if path.stat().st_mtime > killed_at + 0.5]
        assert not written_after, f"written after torchrun was killed: {written_after}"
    finally:
        kill_processes(processes)
        job.kill()


def _file_digests(directory: Path) -> Dict[str, int]:
    return {
        str(path.relative_to(directory)): hash(path.read_bytes()) for path in directory.rglob("*") if path.is_file()
    }


def test_an_interrupted_save_is_reported_on_resume_and_removed_by_the_next_save(golden_run, cpu_data_flags, tmp_path):
    import shutil

    save_dir = tmp_path / "checkpoints"
    shutil.copytree(golden_run.checkpoint_dir / "iter_0000010", save_dir / "iter_0000010")
    (save_dir / "latest_checkpointed_iteration.txt").write_text("10")
    interrupted = save_dir / "iter_0000015"  # what a save killed before its metadata leaves behind
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"\0" * 4096)
    complete_before = _file_digests(save_dir / "iter_0000010")

    resumed = run_pretrain(
        GOLDEN_FLAGS + cpu_data_flags + ["--load", save_dir, "--save", save_dir, "--save-interval", "10"]
    )
    assert f"ignoring incomplete checkpoint iter_0000015 in {save_dir}: no metadata" in resumed.output
    assert f"removed incomplete checkpoint {interrupted}" in resumed.output
    assert not interrupted.exists()
    assert (save_dir / "latest_checkpointed_iteration.txt").read_text() == "20"
    assert _file_digests(save_dir / "iter_0000010") == complete_before


def test_progress_events_of_a_multi_rank_job_are_printed_in_order(cpu_data_flags, tmp_path):
    """Training and validation lines, evaluation progress and checkpoint messages come from one rank (the last),
    so the merged output of TP2 x DP2 (rank 0 is not the last rank) reads in the order things happened."""
    flags = (
        with_flag(with_flag(GOLDEN_FLAGS, "--train-iters", "4"), "--eval-interval", "2")
        + cpu_data_flags
        + [
            "--tensor-model-parallel-size",
            "2",
            "--save",
            tmp_path,
            "--save-interval",
            "2",
        ]
    )
    output = run_pretrain(flags, nproc=4).output
    patterns = {
        "train": re.compile(r"\biteration\s+\d+/\s*\d+ \|"),
        "validation": re.compile(r"validation loss at iteration"),
        "evaluating": re.compile(r"Evaluating iter \d+/"),
        "saving": re.compile(r"saving checkpoint at iteration"),
        "saved": re.compile(r"successfully saved checkpoint from iteration"),
    }
    events = [kind for line in output.splitlines() for kind, pattern in patterns.items() if pattern.search(line)]
    per_save = ["train", "train", "validation", "saving", "saved"]
    assert events == per_save * 2 + ["evaluating"] * 2 + ["validation"], f"{events}\n{output[-3000:]}"
