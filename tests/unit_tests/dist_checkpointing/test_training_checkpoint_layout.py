"""Training-checkpoint layout: names, the atomic "latest" tracker, refusing incomplete checkpoints, and a save
killed midway leaving the previous iteration as latest and loadable."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor, load, save
from megatron.core.dist_checkpointing.checksums import verification
from megatron.training.checkpointing import (
    find_checkpoint_to_load,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    read_metadata,
    write_tracker_atomically,
)
from tests.unit_tests.test_utilities import REPO_ROOT


def test_names_follow_megatron_lm():
    assert get_checkpoint_name("/ckpt", 100, return_base_dir=True) == "/ckpt/iter_0000100"
    assert get_checkpoint_name("/ckpt", 100, release=True, return_base_dir=True) == "/ckpt/release"
    assert get_checkpoint_tracker_filename("/ckpt") == "/ckpt/latest_checkpointed_iteration.txt"


def test_tracker_round_trip_is_atomic(tmp_path):
    write_tracker_atomically(tmp_path, 1200)
    assert read_metadata(get_checkpoint_tracker_filename(tmp_path)) == (1200, False)
    assert os.listdir(tmp_path) == ["latest_checkpointed_iteration.txt"]  # no temporary file left behind
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert read_metadata(tmp_path / "latest_checkpointed_iteration.txt") == (0, True)


@pytest.mark.parametrize(
    "content, match",
    [
        ("", r"holds '', not an iteration number or 'release'"),
        ("12abc", r"holds '12abc', not an iteration number"),
        ("-5", "holds the negative iteration -5"),
    ],
)
def test_corrupt_tracker(tmp_path, content, match):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text(content)
    with pytest.raises(CheckpointingException, match=match):
        read_metadata(tracker)


def test_missing_tracker(tmp_path):
    with pytest.raises(CheckpointingException, match="checkpoint tracker .* does not exist"):
        read_metadata(tmp_path / "latest_checkpointed_iteration.txt")
    assert find_checkpoint_to_load(tmp_path) is None  # nothing saved yet: a fresh start


def _save_iteration(root, iteration, value):
    checkpoint_dir = get_checkpoint_name(root, iteration, return_base_dir=True)
    os.makedirs(checkpoint_dir, exist_ok=True)
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(value))),
        "b": ShardedTensor.from_rank_offsets("b", torch.full((2,), float(value))),
        "iteration": iteration,
    }
    save(state, checkpoint_dir)
    write_tracker_atomically(root, iteration)


def test_find_checkpoint_to_load(tmp_path):
    _save_iteration(tmp_path, 10, 1.0)
    _save_iteration(tmp_path, 20, 2.0)
    assert find_checkpoint_to_load(tmp_path) == (str(tmp_path / "iter_0000020"), 20, False)
    assert find_checkpoint_to_load(tmp_path, iteration=10) == (str(tmp_path / "iter_0000010"), 10, False)
    with pytest.raises(CheckpointingException, match=r"checkpoint .*iter_0000030 \(requested\) does not exist"):
        find_checkpoint_to_load(tmp_path, iteration=30)
    os.remove(tmp_path / "iter_0000020" / ".metadata")
    os.remove(tmp_path / "iter_0000020" / "metadata.json")
    with pytest.raises(
        CheckpointingException,
        match=r"checkpoint .*iter_0000020 \(named by .*latest_checkpointed_iteration.txt\) is incomplete: "
        r"metadata.json, .metadata missing",
    ):
        find_checkpoint_to_load(tmp_path)
    (tmp_path / "iter_0000010" / "metadata.json").write_text("{")
    with pytest.raises(CheckpointingException, match=r"metadata.json is 1 bytes, but \d+ were written"):
        find_checkpoint_to_load(tmp_path, iteration=10)
    with verification(False), pytest.raises(CheckpointingException, match="metadata.json is not valid JSON"):
        find_checkpoint_to_load(tmp_path, iteration=10)


_KILLED_SAVE = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from tests.unit_tests.dist_checkpointing.test_training_checkpoint_layout import _save_iteration

    root, marker = sys.argv[1], Path(sys.argv[2])
    _save_iteration(root, 1, 1.0)
    original = torch_strategy._StagedDataPlanner.resolve_data

    def stall_on_b(self, item):
        if item.index.fqn == "b":
            marker.write_text("writing")
            threading.Event().wait()  # hang mid-write until killed
        return original(self, item)

    torch_strategy._StagedDataPlanner.resolve_data = stall_on_b
    _save_iteration(root, 2, 2.0)
    """
)


def test_a_save_killed_midway_leaves_the_previous_iteration_latest_and_loadable(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "marker"
    root.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(root), str(marker)], cwd=REPO_ROOT, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while not (marker.exists() and marker.read_text() == "writing"):
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "the save never reached its write"
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()

    assert list((root / "iter_0000002").glob("*.distcp"))  # it died with its shard files open
    assert read_metadata(get_checkpoint_tracker_filename(root)) == (1, False)
    checkpoint_dir, iteration, _ = find_checkpoint_to_load(root)
    assert iteration == 1
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, checkpoint_dir)
    assert loaded["w"].tolist() == [1.0] * 4 and loaded["iteration"] == 1
    with pytest.raises(CheckpointingException, match=r"iter_0000002 \(requested\) is incomplete: metadata.json, "):
        find_checkpoint_to_load(root, iteration=2)
