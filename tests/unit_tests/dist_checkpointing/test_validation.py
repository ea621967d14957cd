"""Every save/load validation error and every corrupt-checkpoint path, with its message (one process)."""

import json
import logging

import pytest
import torch

from megatron.core.dist_checkpointing import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    StrictHandling,
    load,
    load_common_state_dict,
    save,
)
from megatron.core.dist_checkpointing import checksums
from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata
from megatron.core.dist_checkpointing.validation import determine_global_metadata, parse_strict_flag


def _piece(key, rows, offset, parts, replica_id=0, total_cols=2):
    data = torch.zeros(rows, total_cols)
    return ShardedTensor.from_rank_offsets(key, data, (0, offset, parts), replica_id=replica_id)


@pytest.mark.parametrize(
    "state, match",
    [
        ({"a": _piece("w", 2, 0, 2), "b": _piece("w", 2, 0, 2)}, r"main replicas overlap: offset \(0, 0\)"),
        ({"a": _piece("w", 2, 0, 2)}, r"cover 4 of the 8 elements of global shape \(4, 2\); pieces are missing"),
        ({"a": _piece("w", 4, 0, 1, replica_id=1)}, "has no main replica"),
        (
            {"a": _piece("w", 4, 0, 1), "b": ShardedObject("w", 1, (1,), (0,))},
            "key 'w' is used by both ShardedObject and ShardedTensor",
        ),
        (
            {"a": ShardedObject("o", 1, (2,), (0,)), "b": ShardedObject("o", 2, (2,), (0,))},
            r"ShardedObject 'o' shard \(0,\) has main replicas on ranks \[0, 0\]",
        ),
        ({"a": ShardedObject("o", 1, (2,), (0,))}, r"misses shards \[\(1,\)\]: no rank holds them"),
        (
            {"a": ShardedObject("o", 1, (2,), (0,)), "b": ShardedObject("o", 1, (2,), (1,), replica_id=1)},
            r"misses shards \[\(1,\)\]: no copy of them has replica_id 0",
        ),
        (
            {"a": _piece("w", 2, 0, 2), "b": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 2))},
            r"has global shape \(4, 2\) on rank 0 but \(4, 3\) on rank 0",
        ),
        (
            {"a": _piece("w", 2, 0, 2), "b": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2).half(), (0, 1, 2))},
            "has dtype torch.float32 on rank 0 but torch.float16",
        ),
        ({"a": _piece("w", 4, 0, 1).without_data()}, "ShardedTensor 'w' has no data to save"),
    ],
)
def test_bad_sharding_is_refused_before_anything_is_written(tmp_path, state, match):
    with pytest.raises(CheckpointingException, match=match):
        save(state, tmp_path)
    assert not (tmp_path / "metadata.json").exists()


def test_validation_can_be_skipped(tmp_path):
    state = {"a": _piece("w", 4, 0, 1, replica_id=1), "b": _piece("w", 4, 0, 1)}
    save(state, tmp_path, validate_access_integrity=False)


def test_save_into_a_missing_directory(tmp_path):
    with pytest.raises(CheckpointingException, match=r"checkpoint directory .*missing does not exist; create it"):
        save({"a": _piece("w", 4, 0, 1)}, tmp_path / "missing")


def test_async_save_needs_an_async_strategy(tmp_path):
    class SyncOnly:
        backend, version = "torch_dist", 1

    with pytest.raises(CheckpointingException, match="needs an AsyncSaveShardedStrategy, got SyncOnly"):
        save({}, tmp_path, sharded_strategy=SyncOnly(), async_sharded_save=True)


@pytest.fixture
def checkpoint(tmp_path):
    save({"a": _piece("a", 4, 0, 1), "b": _piece("b", 4, 0, 1), "o": ShardedObject("obj", 3, (1,), (0,))}, tmp_path)
    return tmp_path


@pytest.fixture
def unverified(checkpoint):
    """The checkpoint without checksum records (as Megatron writes it): the tests that edit its files check what the
    files say, not their bytes (test_checksums.py refuses the same edits earlier, by checksum)."""
    checksums.remove_records(checkpoint)
    return checkpoint


def test_directory_errors(tmp_path, checkpoint):
    with pytest.raises(CheckpointingException, match="checkpoint directory .*nowhere does not exist"):
        load({}, tmp_path / "nowhere")
    (checkpoint / "metadata.json").unlink()
    with pytest.raises(CheckpointingException, match="is not a distributed checkpoint: metadata.json is missing"):
        load({}, checkpoint)


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "is not valid JSON"),
        ('{"sharded_backend_version": 1}', "names no sharded_backend"),
        ('{"sharded_backend": "zarr", "sharded_backend_version": 1}', "no load_sharded strategy for backend 'zarr'"),
        (
            '{"sharded_backend": "torch_dist", "sharded_backend_version": 2}',
            "no load_sharded strategy for backend 'torch_dist' version 2; megatron-lite provides torch_dist v1",
        ),
    ],
)
@pytest.mark.usefixtures("unverified")
def test_bad_metadata_json(checkpoint, content, match):
    (checkpoint / "metadata.json").write_text(content)
    with pytest.raises(CheckpointingException, match=match):
        load({"a": _piece("a", 4, 0, 1)}, checkpoint)


@pytest.mark.usefixtures("unverified")
def test_megatron_metadata_json_with_only_the_sharded_fields_loads(checkpoint):
    config = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    (checkpoint / "metadata.json").write_text(json.dumps(config))
    assert load({"a": _piece("a", 4, 0, 1)}, checkpoint)["a"].shape == (4, 2)


@pytest.mark.usefixtures("unverified")
def test_missing_or_corrupt_files(checkpoint):
    metadata = (checkpoint / ".metadata").read_bytes()
    (checkpoint / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointingException, match=r"\.metadata is corrupt"):
        load({"a": _piece("a", 4, 0, 1)}, checkpoint)
    (checkpoint / ".metadata").unlink()
    with pytest.raises(CheckpointingException, match=r"\.metadata is missing: the checkpoint .* is incomplete"):
        load({"a": _piece("a", 4, 0, 1)}, checkpoint)
    for shard_file in checkpoint.glob("*.distcp"):
        shard_file.unlink()
    (checkpoint / ".metadata").write_bytes(metadata)
    with pytest.raises(CheckpointingException, match=r"rank 0 could not read .*__0_0.distcp: the file is missing"):
        load_common_state_dict(checkpoint)


def test_truncated_shard_file(checkpoint):
    for shard_file in checkpoint.glob("*.distcp"):
        shard_file.write_bytes(shard_file.read_bytes()[:20])
    with pytest.raises(
        CheckpointingException,
        match=r"rank 0 could not read .*__0_0.distcp: the file is truncated \(20 bytes, the checkpoint needs \d+\)\. "
        r"The checkpoint .* is damaged; load an earlier checkpoint \(--ckpt-step",
    ):
        load({"a": _piece("a", 4, 0, 1), "b": _piece("b", 4, 0, 1)}, checkpoint)


@pytest.mark.usefixtures("unverified")
def test_corrupt_bytes_inside_a_shard_file_name_the_file(checkpoint):
    metadata = read_dcp_metadata(checkpoint)
    (index,) = [i for i in metadata.storage_data if i.fqn == "b"]
    info = metadata.storage_data[index]
    shard_file = checkpoint / info.relative_path
    content = bytearray(shard_file.read_bytes())
    content[info.offset : info.offset + info.length] = bytes(info.length)  # same length, nothing readable
    shard_file.write_bytes(bytes(content))
    with pytest.raises(
        CheckpointingException, match=rf"rank 0 could not read .*{shard_file.name}: its content is corrupt"
    ):
        load({"a": _piece("a", 4, 0, 1), "b": _piece("b", 4, 0, 1)}, checkpoint)


def test_global_shape_mismatch_names_both_shapes(checkpoint):
    with pytest.raises(
        CheckpointingException,
        match=r"ShardedTensor 'a': the model expects global shape \(6, 2\) but the checkpoint .* stores \(4, 2\)",
    ):
        load({"a": _piece("a", 6, 0, 1)}, checkpoint)


def test_object_requested_at_another_sharding_is_named(checkpoint):
    with pytest.raises(CheckpointingException, match=r"ShardedObject 'obj' shard \(1,\) of \(2,\) .* is not in"):
        load({"o": ShardedObject("obj", None, (2,), (1,))}, checkpoint, validate_access_integrity=False)


def test_tensor_stored_as_object(checkpoint):
    with pytest.raises(CheckpointingException, match="is an object, not a tensor"):
        load({"o": ShardedTensor.from_rank_offsets("obj/shard_0_1", torch.zeros(1))}, checkpoint)


# Requests for the strictness tests: "a" is in the checkpoint, "c" is not (unexpected); "b" and "obj" are in the
# checkpoint but not requested (missing).
def _mismatched_request():
    return {"a": _piece("a", 4, 0, 1), "c": _piece("c", 4, 0, 1)}


def test_assume_ok_unexpected_fails_in_the_reader(checkpoint):
    with pytest.raises(CheckpointingException, match="ShardedTensor 'c' is not in the checkpoint"):
        load(_mismatched_request(), checkpoint)


@pytest.mark.parametrize(
    "strict, match",
    [
        ("raise_unexpected", r"not in the checkpoint \(unexpected\): \['c'\]$"),
        ("raise_all", r"no rank requested \(missing\): \['b', 'obj'\]; .*\(unexpected\): \['c'\]"),
    ],
)
def test_raise_modes(checkpoint, strict, match):
    with pytest.raises(CheckpointingException, match=match):
        load(_mismatched_request(), checkpoint, strict=strict)


def test_raise_all_passes_on_an_exact_match(checkpoint):
    request = {"a": _piece("a", 4, 0, 1), "b": _piece("b", 4, 0, 1), "o": ShardedObject("obj", None, (1,), (0,))}
    assert load(request, checkpoint, strict=StrictHandling.RAISE_ALL)["o"] == 3


@pytest.mark.parametrize("strict, logs_missing", [("log_unexpected", False), ("log_all", True)])
def test_log_modes_warn_and_skip_unexpected_keys(checkpoint, caplog, strict, logs_missing):
    with caplog.at_level(logging.WARNING):
        loaded = load(_mismatched_request(), checkpoint, strict=strict)
    assert "a" in loaded and "c" not in loaded
    assert "(unexpected): ['c']" in caplog.text
    assert ("(missing)" in caplog.text) == logs_missing


@pytest.mark.parametrize(
    "strict, missing",
    [(StrictHandling.RETURN_UNEXPECTED, set()), (StrictHandling.RETURN_ALL, {"b", "obj"})],
)
def test_return_modes_return_the_mismatches(checkpoint, strict, missing):
    loaded, missing_keys, unexpected_keys = load(_mismatched_request(), checkpoint, strict=strict)
    assert "c" not in loaded and (missing_keys, unexpected_keys) == (missing, {"c"})


def test_ignore_all_skips_silently(checkpoint, caplog):
    with caplog.at_level(logging.WARNING):
        loaded = load(_mismatched_request(), checkpoint, strict="ignore_all")
    assert sorted(k for k in loaded if isinstance(loaded[k], torch.Tensor)) == ["a"] and not caplog.text


def test_unknown_strict_flag():
    with pytest.raises(ValueError, match="strict='lenient' is not a strictness mode; choose one of 'assume_ok_"):
        parse_strict_flag("lenient")


def test_determine_global_metadata_gathers_over_the_given_group(monkeypatch):
    # An explicit group means a real collective: its size and the gather come from that group.
    calls = []
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: calls.append(group) or 3)
    monkeypatch.setattr(
        torch.distributed, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * 3)
    )
    group = object()
    shard = ShardedTensor.from_rank_offsets("w", torch.zeros(2))
    local, gathered = determine_global_metadata({"w": shard, "step": 3}, process_group=group)
    assert calls == [group]
    assert [s.key for s in local] == ["w"] and local[0].data is None
    assert gathered == [local, local, local]
