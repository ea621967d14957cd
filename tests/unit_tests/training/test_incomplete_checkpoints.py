"""Directories left by interrupted saves are found, described and removed; complete checkpoints never are."""

from megatron.core.dist_checkpointing.core import CONFIG_FNAME
from megatron.core.dist_checkpointing.strategies.torch import DCP_METADATA_FNAME
from megatron.training.checkpointing import (
    describe_incomplete_checkpoints,
    incomplete_checkpoints,
    remove_incomplete_checkpoints,
)


def _checkpoint(root, iteration, files):
    directory = root / f"iter_{iteration:07d}"
    directory.mkdir()
    for name in files:
        (directory / name).write_text("x")
    return directory


def _layout(tmp_path):
    complete = [_checkpoint(tmp_path, i, [CONFIG_FNAME, DCP_METADATA_FNAME, "__0_0.distcp"]) for i in (10, 30)]
    no_config = _checkpoint(tmp_path, 20, [DCP_METADATA_FNAME, "__0_0.distcp"])
    no_index = _checkpoint(tmp_path, 5, ["__0_0.distcp"])
    later = _checkpoint(tmp_path, 40, [])
    (tmp_path / "iter_notanumber").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("30")
    return complete, [no_index, no_config, later]


def test_only_directories_without_metadata_are_incomplete(tmp_path):
    complete, incomplete = _layout(tmp_path)
    assert incomplete_checkpoints(tmp_path) == [
        (5, str(incomplete[0])),
        (20, str(incomplete[1])),
        (40, str(incomplete[2])),
    ]
    assert incomplete_checkpoints(tmp_path / "missing") == []


def test_each_incomplete_checkpoint_is_described_once(tmp_path):
    _layout(tmp_path)
    lines = describe_incomplete_checkpoints(tmp_path)
    assert lines[0] == (
        f"ignoring incomplete checkpoint iter_0000005 in {tmp_path}: no metadata (its save was interrupted); "
        "it is removed after the next successful save"
    )
    assert len(lines) == 3


def test_removal_spares_complete_checkpoints_and_later_saves_in_flight(tmp_path):
    complete, incomplete = _layout(tmp_path)
    removed = remove_incomplete_checkpoints(tmp_path, saved_iteration=30)
    assert removed == [str(incomplete[0]), str(incomplete[1])]
    assert all(directory.exists() for directory in complete)
    assert incomplete[2].exists()  # iteration 40 may be an asynchronous save still being written
    assert (tmp_path / "iter_notanumber").exists()
