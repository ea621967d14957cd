"""The Megatron-Core 0.19 names of dist_checkpointing, each doing what its name says (one process unless noted)."""

import json
import io
import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron.core.dist_checkpointing.checksums import verification
from megatron.core.dist_checkpointing import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    StrictHandling,
    load,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from megatron.core.dist_checkpointing.dict_utils import dict_map, dict_map_with_key, inspect_types, map_reduce
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    flatten_state_dict,
)
from megatron.core.dist_checkpointing.validation import (
    adjust_non_strict_load,
    determine_global_metadata,
    maybe_report_missing_and_unexpected_keys,
    save_integrity_manifest,
    validate_integrity_and_strict_load,
    verify_checkpoint,
    verify_integrity_manifest,
)
from tests.unit_tests.test_utilities import run_distributed


def _state(value=1.0):
    return {
        "model": {"w": ShardedTensor.from_rank_offsets("model.w", torch.full((4, 2), value))},
        "optimizer": {"m": ShardedTensor.from_rank_offsets("optimizer.m", torch.full((3,), value))},
        "iteration": 3,
    }


def test_dict_map_and_dict_map_with_key_replace_leaves_in_place():
    d = {"a": 1, "b": {"c": 2, "d": [3]}}
    dict_map(lambda v: v * 2, d)
    assert d == {"a": 2, "b": {"c": 4, "d": [3, 3]}}  # a list is a leaf
    d = {"a": 1, "b": {"c": 2}}
    dict_map_with_key(lambda k, v: f"{k}={v}", d)
    assert d == {"a": "a=1", "b": {"c": "c=2"}}
    assert map_reduce([1, 2, 3, 4], key_fn=lambda x: x % 2) == {1: [1, 3], 0: [2, 4]}


def test_inspect_types_prints_the_nesting(capsys):
    inspect_types({"model": {"w": torch.zeros(2, 3)}, "it": 4, "xs": [1.0]}, indent=2)
    assert capsys.readouterr().out.splitlines() == [
        "model: dict of 1",
        "  w: Tensor (2, 3) torch.float32",
        "it: int",
        "xs: list of 1",
        "  0: float",
    ]


def test_default_strategies():
    assert isinstance(get_default_save_sharded_strategy(), TorchDistSaveShardedStrategy)
    assert isinstance(get_default_load_sharded_strategy(), TorchDistLoadShardedStrategy)
    with pytest.raises(CheckpointingException, match="no save_sharded strategy for backend 'zarr'"):
        get_default_save_sharded_strategy("zarr")


def test_save_strategy_options(tmp_path):
    strategy = TorchDistSaveShardedStrategy(thread_count=3, cached_metadata=True)
    save(_state(), tmp_path, strategy)
    assert len(list(tmp_path.glob("__0_*.distcp"))) == 3
    for kwargs, match in [
        ({"keep_only_main_replica": False}, r"not supported yet: writing every replica \(keep_only_main_replica"),
        ({"separation_hint": "optimizer"}, r"not supported yet: separate files per key prefix \(separation_hint"),
        ({"cpu_shm_mode": True}, r"not supported yet: staging in shared memory \(cpu_shm_mode=True\)"),
        ({"thread_count": 0}, "thread_count=0 must be at least 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            TorchDistSaveShardedStrategy(**kwargs)


def test_async_strategy_names(tmp_path):
    request = save(_state(), tmp_path, async_sharded_save=True, async_strategy="mcore")
    request.execute_sync()
    assert verify_checkpoint(str(tmp_path)).sharded_backend == "torch_dist"
    with pytest.raises(CheckpointingException, match="async_strategy='threads' is not one of 'nvrx', 'mcore'"):
        save(_state(), tmp_path, async_sharded_save=True, async_strategy="threads")


def test_load_strategy_caches_metadata_when_asked(tmp_path):
    save(_state(), tmp_path)
    cached = TorchDistLoadShardedStrategy(cache_metadata=True, checkpoint_name="run-7")
    assert set(cached.load_tensors_metadata(tmp_path)) == {"model.w", "optimizer.m"}
    (tmp_path / ".metadata").write_bytes(b"garbage")
    assert set(cached.load_tensors_metadata(tmp_path)) == {"model.w", "optimizer.m"}  # not read again
    with pytest.raises(CheckpointingException, match=r"\.metadata is 7 bytes, but \d+ were written"):
        TorchDistLoadShardedStrategy().load_tensors_metadata(tmp_path)
    with verification(False), pytest.raises(CheckpointingException, match=r"\.metadata is corrupt"):
        TorchDistLoadShardedStrategy().load_tensors_metadata(tmp_path)


def test_remove_sharded_tensors_drops_them_from_later_loads(tmp_path):
    save(_state(2.0), tmp_path)
    remove_sharded_tensors(str(tmp_path), "optimizer.")
    assert set(load_tensors_metadata(str(tmp_path))) == {"model.w"}
    assert "common_state/shard_0_1" in load_sharded_metadata(str(tmp_path))
    loaded = load({"model": _state()["model"]}, str(tmp_path), strict="raise_all")
    assert torch.equal(loaded["model"]["w"], torch.full((4, 2), 2.0)) and loaded["iteration"] == 3
    with pytest.raises(CheckpointingException, match="'optimizer.m' is not in the checkpoint"):
        load(_state(), str(tmp_path))


def test_integrity_manifest(tmp_path):
    save(_state(), tmp_path, verify_integrity=True)
    manifest = json.loads((tmp_path / "integrity.json").read_text())  # Megatron-Core's file name and schema
    assert manifest["algorithm"] == "sha256"
    assert set(manifest["files"]) == {p.name for p in tmp_path.iterdir() if p.is_file() and p.name != "integrity.json"}
    assert all(len(digest) == 64 for digest in manifest["files"].values())
    assert load(_state(0.0), str(tmp_path), verify_integrity=True)["iteration"] == 3
    shard_file = next(tmp_path.glob("*.distcp"))
    content = bytearray(shard_file.read_bytes())
    content[-1] ^= 0xFF
    shard_file.write_bytes(bytes(content))
    with pytest.raises(
        CheckpointingException,
        match=rf"does not match its integrity manifest: {shard_file.name} differs \(sha256 ",
    ):
        load(_state(), str(tmp_path), verify_integrity=True)
    shard_file.unlink()
    with pytest.raises(CheckpointingException, match=rf"{shard_file.name} is missing"):
        verify_integrity_manifest(str(tmp_path))
    (tmp_path / "integrity.json").unlink()
    with pytest.raises(CheckpointingException, match="integrity.json is missing: the checkpoint was saved without"):
        verify_integrity_manifest(str(tmp_path))
    save_integrity_manifest(str(tmp_path))  # a manifest of the directory as it is now
    verify_integrity_manifest(str(tmp_path))


def test_integrity_manifest_errors_and_the_legacy_file(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    save_integrity_manifest(str(tmp_path))
    manifest = json.loads((tmp_path / "integrity.json").read_text())
    (tmp_path / "integrity.json").write_text(json.dumps({**manifest, "algorithm": "md5"}))
    with pytest.raises(CheckpointingException, match="uses hash algorithm 'md5'; only 'sha256' is supported"):
        verify_integrity_manifest(str(tmp_path))
    (tmp_path / "integrity.json").write_text(json.dumps({"algorithm": "sha256"}))
    with pytest.raises(CheckpointingException, match='has no "files" mapping'):
        verify_integrity_manifest(str(tmp_path))
    (tmp_path / "integrity.json").write_text("{")
    with pytest.raises(CheckpointingException, match="integrity.json is not valid JSON"):
        verify_integrity_manifest(str(tmp_path))
    # This project's earlier manifest ({name: {"size", "sha256"}}) is still verified.
    (tmp_path / "integrity.json").unlink()
    legacy = {"a.bin": {"size": 3, "sha256": manifest["files"]["a.bin"]}}
    (tmp_path / "integrity_manifest.json").write_text(json.dumps(legacy))
    verify_integrity_manifest(str(tmp_path))
    (tmp_path / "a.bin").write_bytes(b"abd")
    with pytest.raises(CheckpointingException, match="a.bin differs"):
        verify_integrity_manifest(str(tmp_path))


def test_verify_checkpoint(tmp_path):
    with pytest.raises(CheckpointingException, match="does not exist"):
        verify_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointingException, match="is not a distributed checkpoint: metadata.json is missing"):
        verify_checkpoint(str(tmp_path))


def test_strictness_helpers(tmp_path, caplog):
    save(_state(), tmp_path)
    stored = load_sharded_metadata(str(tmp_path))
    request = {**_state(), "extra": ShardedTensor.from_rank_offsets("extra", torch.zeros(2))}
    local, global_ = determine_global_metadata(request)
    assert [sh.key for sh in local] == ["model.w", "optimizer.m", "extra"] and global_ == [local]
    assert all(sh.data is None for sh in local)
    assert list(adjust_non_strict_load(request, {"extra"})) == ["model", "optimizer", "iteration"]

    kept, missing, unexpected = validate_integrity_and_strict_load(
        request, StrictHandling.RETURN_ALL, True, ckpt_sharded_metadata=stored
    )
    assert "extra" not in kept and unexpected == {"extra"} and missing == {"common_state"}
    with pytest.raises(CheckpointingException, match=r"not in the checkpoint \(unexpected\): \['extra'\]"):
        validate_integrity_and_strict_load(
            request, StrictHandling.RAISE_UNEXPECTED, False, ckpt_sharded_metadata=stored
        )
    with caplog.at_level(logging.WARNING):
        validate_integrity_and_strict_load(request, StrictHandling.LOG_UNEXPECTED, False, ckpt_sharded_metadata=stored)
    assert "skipping mismatched keys" in caplog.text
    with pytest.raises(CheckpointingException, match="needs the checkpoint's sharded metadata"):
        validate_integrity_and_strict_load(request, StrictHandling.RAISE_ALL, False)
    maybe_report_missing_and_unexpected_keys(set(), set())  # nothing to report
    with pytest.raises(CheckpointingException, match=r"no rank requested \(missing\): \['a'\]"):
        maybe_report_missing_and_unexpected_keys({"a"}, set())


def _load_within_a_group(directory):
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    if rank >= 2:
        return None  # ranks 2 and 3 take no part in the group's load
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2), (0, rank, 2))}
    loaded = load(request, directory, process_group=group)
    return loaded["w"].tolist(), loaded["iteration"]


def test_load_within_a_process_group(tmp_path):
    piece = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0).reshape(4, 2)), "iteration": 5}
    save(piece, tmp_path)
    results = run_distributed(4, _load_within_a_group, tmp_path)
    assert results[0] == ([[0.0, 1.0], [2.0, 3.0]], 5) and results[1] == ([[4.0, 5.0], [6.0, 7.0]], 5)
    assert results[2:] == [None, None]


def test_flatten_state_dict():
    flat, paths = flatten_state_dict({"model": {"w": 1, "layers": [2, {"b": 3}]}, "it": 4, "empty": {}})
    assert flat == {"model.w": 1, "model.layers.0": 2, "model.layers.1.b": 3, "it": 4, "empty": {}}
    assert paths["model.layers.1.b"] == ("model", "layers", 1, "b")
    with pytest.raises(CheckpointingException, match=r"both flatten to 'a.b'"):
        flatten_state_dict({"a": {"b": 1}, "a.b": 2})


def test_megatron_planners_with_pytorch_dcp(tmp_path):
    """MCoreSavePlanner stores BytesIO values as bytes (so the objects load here); MCoreLoadPlanner checks shapes."""
    buffer = io.BytesIO()
    torch.save(["payload"], buffer)
    buffer.seek(0)
    dcp.save(
        {"w": torch.ones(4, 2), "obj/shard_0_1": buffer},
        checkpoint_id=str(tmp_path),
        no_dist=True,
        planner=MCoreSavePlanner(),
    )
    loaded = TorchDistLoadShardedStrategy().load_local({"o": ShardedObject("obj", None, (1,), (0,))}, tmp_path)
    assert loaded["o"] == "payload"

    target = {"w": torch.zeros(4, 2)}
    expected = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 2))
    dcp.load(
        target,
        checkpoint_id=str(tmp_path),
        no_dist=True,
        planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=[expected]),
    )
    assert torch.equal(target["w"], torch.ones(4, 2))
    wrong = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3))
    # PyTorch's loader wraps the planner's CheckpointingException (traceback included) in its CheckpointException,
    # a BaseException.
    with pytest.raises(BaseException, match=r"'w': the checkpoint stores global shape \(4, 2\) but \(4, 3\)"):
        dcp.load(
            target,
            checkpoint_id=str(tmp_path),
            no_dist=True,
            planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=[wrong]),
        )
    padded = {"w": torch.full((5, 3), 7.0)}  # e.g. a vocabulary padded further than the saved one
    dcp.load(
        padded,
        checkpoint_id=str(tmp_path),
        no_dist=True,
        planner=MCoreLoadPlanner(
            shapes_validation_sharded_tensors=[wrong], allow_shape_mismatch_sharded_tensors={"w": wrong}
        ),
    )
    assert torch.equal(padded["w"][:4, :2], torch.ones(4, 2))
    assert padded["w"][4:].abs().sum() == 0 and padded["w"][:, 2:].abs().sum() == 0
