"""Checksums of the training checkpoints: a damaged torch_dist shard stops load_checkpoint (and --no-ckpt-verify
lets it through); damaged legacy (model_optim_rng.pt, distrib_optim.pt) and torch_dcp files, at their start, middle
and end, are named on load and left as they are; a damaged tracker gets a clear message."""

import os
import re

import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.dist_checkpointing.checkpoint_dir import find_checkpoint_to_load, write_tracker_atomically
from megatron.core.dist_checkpointing.checksums import capture_records, safe_torch_load_verified, torch_save
from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata
from megatron.training import checkpointing, global_vars
from megatron.training.dcp_checkpointing import load_dcp_checkpoint, save_dcp_checkpoint
from megatron.training.legacy_checkpointing import _move_into_place, load_legacy_state_dict
from tests.unit_tests.test_utilities import run_distributed
from tests.unit_tests.training.test_arguments import parse
from tests.unit_tests.training.test_checkpointing import _setup, _train_one_step

WHERE = ["start", "middle", "end"]
CORRUPT = r"checkpoint file {} is corrupt: bytes (\d+)-(\d+) \(of \d+\)"


def _flip(path, where):
    content = bytearray(open(path, "rb").read())
    position = {"start": 0, "middle": len(content) // 2, "end": len(content) - 1}[where]
    content[position] ^= 0xFF
    with open(path, "wb") as file:
        file.write(bytes(content))
    return position


def _assert_names(message, path, position):
    found = re.search(CORRUPT.format(re.escape(str(path))), message)
    assert found, message
    assert int(found.group(1)) <= position <= int(found.group(2))


def test_the_flag_is_ours_and_on_by_default():
    assert parse().ckpt_verify is True and parse("--no-ckpt-verify").ckpt_verify is False


# ---- legacy --ckpt-format torch files ----------------------------------------------------------------------------


def _legacy_checkpoint(root):
    """iter_0000007/mp_rank_00/{model_optim_rng.pt, distrib_optim.pt} written the way save_legacy_checkpoint does."""
    files = {}
    for name, state in [("model_optim_rng.pt", {"model": {"w": torch.ones(300, 300)}}), ("distrib_optim.pt", [1])]:
        path = root / "iter_0000007" / "mp_rank_00" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with capture_records() as records:
            torch_save(state, f"{path}.tmp")
        _move_into_place(f"{path}.tmp", str(path), records)
        files[name] = path
    return files


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", ["model_optim_rng.pt", "distrib_optim.pt"])
def test_a_damaged_legacy_file_is_named(tmp_path, name, where):
    path = _legacy_checkpoint(tmp_path)[name]
    position = _flip(path, where)
    before = path.read_bytes()
    with pytest.raises(CheckpointingException) as raised:
        if name == "model_optim_rng.pt":
            load_legacy_state_dict(str(tmp_path / "iter_0000007"), 7, False)
        else:
            safe_torch_load_verified(str(path), "the distributed optimizer's parameter state")  # as the optimizer
    _assert_names(str(raised.value), path, position)
    assert path.read_bytes() == before


def test_an_intact_legacy_file_loads(tmp_path):
    _legacy_checkpoint(tmp_path)
    state = load_legacy_state_dict(str(tmp_path / "iter_0000007"), 7, False)
    assert torch.equal(state["model"]["w"], torch.ones(300, 300))


# ---- torch_dcp --------------------------------------------------------------------------------------------------


def _dcp_damage(directory):
    results = []
    for name in ("__0_0.distcp", ".metadata"):
        for where in WHERE:
            save_dcp_checkpoint({"w": torch.ones(300, 300), "step": 3}, directory)
            path = os.path.join(directory, name)
            position = _flip(path, where)
            try:
                load_dcp_checkpoint({"w": torch.zeros(300, 300), "step": None}, directory)
                results.append((path, position, None))
            except CheckpointingException as error:
                results.append((path, position, str(error)))
    dist.barrier()
    return results


def test_a_damaged_torch_dcp_file_is_named(tmp_path):
    (results,) = run_distributed(1, _dcp_damage, str(tmp_path))
    for path, position, message in results:
        assert message is not None, (path, position)
        _assert_names(message, path, position)


# ---- the tracker ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
def test_a_damaged_tracker_is_named(tmp_path, where):
    (tmp_path / "iter_0000123").mkdir()
    write_tracker_atomically(tmp_path, 123)
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    _flip(tracker, where)
    with pytest.raises(CheckpointingException, match=rf"checkpoint tracker {tracker} is damaged \(it holds non-text"):
        find_checkpoint_to_load(tmp_path)
    tracker.write_text("183")  # a changed digit names a checkpoint that is not there
    with pytest.raises(CheckpointingException, match=rf"iter_0000183 \(named by {tracker}\) does not exist"):
        find_checkpoint_to_load(tmp_path)


# ---- load_checkpoint ----------------------------------------------------------------------------------------------


def _save_damage_and_load(root):
    """The issue's case: a shard overwritten in its middle, same size, then resumed; and with --no-ckpt-verify."""
    try:
        model, optimizer, scheduler = _setup(root, 1)
        _train_one_step(model, optimizer, scheduler)
        checkpointing.save_checkpoint(3, model, optimizer, scheduler, 0)
        global_vars.unset_global_variables()
        shard = os.path.join(root, "iter_0000003", "__1_0.distcp")
        if dist.get_rank() == 0:
            # Overwrite (same size) the middle of the largest tensor rank 1 stored: its values, not its headers, so
            # the unverified load below reads it without noticing.
            stored = read_dcp_metadata(os.path.dirname(shard)).storage_data.values()
            largest = max((info for info in stored if info.relative_path == "__1_0.distcp"), key=lambda i: i.length)
            with open(shard, "r+b") as file:
                file.seek(largest.offset + largest.length // 2)
                file.write(os.urandom(1024))
        dist.barrier()
        model, optimizer, scheduler = _setup(root, 2)
        try:
            checkpointing.load_checkpoint(model, optimizer, scheduler, load_arg="save")
            refused = None
        except CheckpointingException as error:
            refused = str(error)
        global_vars.unset_global_variables()
        model, optimizer, scheduler = _setup(root, 2, "--no-ckpt-verify")
        iteration, _ = checkpointing.load_checkpoint(model, optimizer, scheduler, load_arg="save")
        return refused, iteration
    finally:
        global_vars.unset_global_variables()


def test_load_checkpoint_stops_at_a_damaged_shard_unless_told_not_to_verify(tmp_path):
    for refused, iteration in run_distributed(2, _save_damage_and_load, str(tmp_path)):
        assert re.search(CORRUPT.format(re.escape(str(tmp_path / "iter_0000003" / "__1_0.distcp"))), refused)
        assert iteration == 3  # --no-ckpt-verify: loaded as it is, at the user's risk
