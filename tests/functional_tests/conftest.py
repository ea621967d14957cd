"""Runs several functional tests share, started once per session (each is a real torchrun job of a few seconds)."""

from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest

from tests.functional_tests.configs import (
    EQUIVALENCE_FLAGS,
    EQUIVALENCE_REFERENCE_ITERS,
    GOLDEN_FLAGS,
    PARALLEL_LAYOUTS,
    with_flag,
)
from tests.functional_tests.harness import CPU_FLAGS, RunResult, builtin_data_flags, run_pretrain


@dataclass
class CheckpointedRun:
    result: RunResult
    checkpoint_dir: Path


@pytest.fixture(scope="session")
def cpu_data_flags(tmp_path_factory) -> List[str]:
    """CPU switches plus the built-in corpus, with the dataset index cache in a session directory (not the source
    tree): the first run builds the indices, the others reuse them."""
    return CPU_FLAGS + builtin_data_flags(tmp_path_factory.mktemp("gpt_dataset_cache"))


@pytest.fixture(scope="session")
def golden_run(tmp_path_factory, cpu_data_flags) -> CheckpointedRun:
    """The golden configuration on one rank, saving at iterations 10 and 20."""
    save_dir = tmp_path_factory.mktemp("golden_checkpoints")
    result = run_pretrain(GOLDEN_FLAGS + cpu_data_flags + ["--save", save_dir, "--save-interval", "10"])
    return CheckpointedRun(result, save_dir)


@pytest.fixture(scope="session")
def equivalence_reference(cpu_data_flags) -> RunResult:
    """The equivalence model at TP1 PP1 DP1, run to EQUIVALENCE_REFERENCE_ITERS."""
    flags = with_flag(EQUIVALENCE_FLAGS, "--train-iters", str(EQUIVALENCE_REFERENCE_ITERS))
    return run_pretrain(flags + cpu_data_flags)


@pytest.fixture(scope="session")
def tp2_pp2_run(tmp_path_factory, cpu_data_flags) -> CheckpointedRun:
    """TP2 x PP2 with the distributed optimizer: planned like the reference (same --train-iters, so the same LR and
    weight-decay schedule) but stopped by --exit-interval at iteration 10, after saving there, in the
    fully_reshardable layout so that it resumes at another tensor/pipeline layout."""
    name, nproc, layout_flags = PARALLEL_LAYOUTS[0]
    assert name == "tp2_pp2_distopt"
    save_dir = tmp_path_factory.mktemp("tp2_pp2_checkpoints")
    flags = (
        with_flag(EQUIVALENCE_FLAGS, "--train-iters", str(EQUIVALENCE_REFERENCE_ITERS))
        + layout_flags
        + [
            "--exit-interval",
            "10",
            "--save",
            save_dir,
            "--save-interval",
            "10",
            "--dist-ckpt-optim-fully-reshardable",
        ]
    )
    return CheckpointedRun(run_pretrain(flags + cpu_data_flags, nproc), save_dir)
