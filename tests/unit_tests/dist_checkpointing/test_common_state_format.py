"""The Megatron-Core 0.19 checkpoint format: the common state inside the DCP files, both ways.

- what save writes: no ``common.pt``; the ShardedObject ``common_state/shard_0_1`` holding ``torch.save([state])``;
  ``metadata.json`` with 0.19's two fields;
- a checkpoint written by another DCP writer in 0.19's layout (PyTorch's own ``dcp.save``) loads;
- a legacy checkpoint (``common.pt``, four-field ``metadata.json``, no ``common_state``) loads;
- a GPT with its optimizer and per-rank RNG state round-trips at TP1, TP2 and PP2;
- a corrupt or missing common-state entry gives an error naming the checkpoint.
"""

import argparse
import io
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.core.dist_checkpointing.checksums import verification
from megatron.core.dist_checkpointing import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    load,
    load_common_state_dict,
    load_content_metadata,
    save,
)
from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner, read_dcp_metadata
from tests.unit_tests.dist_checkpointing import gpt_checkpoint_helpers as helpers
from tests.unit_tests.dist_checkpointing.test_serialization import load_plain_objects
from tests.unit_tests.test_utilities import run_distributed

COMMON = {"iteration": 12, "args": argparse.Namespace(lr=0.5, tensor_model_parallel_size=1), "checkpoint_version": 3.0}


def _request(rows=4):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(rows, 3))}


def test_save_writes_the_common_state_into_the_dcp_files(tmp_path):
    weight = torch.randn(4, 3)
    save({"w": ShardedTensor.from_rank_offsets("w", weight), **COMMON}, tmp_path, content_metadata={"format": 2})
    assert "common.pt" not in os.listdir(tmp_path)
    assert json.loads((tmp_path / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
    }
    stored = read_dcp_metadata(tmp_path).state_dict_metadata
    assert sorted(stored) == ["common_state/shard_0_1", "w"]
    (common,) = load_plain_objects(tmp_path)["common_state/shard_0_1"]  # torch.save([common state])
    assert common == {**COMMON, "content_metadata": {"format": 2}}
    loaded = load(_request(), tmp_path)
    assert torch.equal(loaded["w"], weight) and loaded["args"] == COMMON["args"] and loaded["iteration"] == 12
    assert load_common_state_dict(tmp_path)["args"].lr == 0.5
    assert load_content_metadata(tmp_path) == {"format": 2}
    assert load_content_metadata(preloaded_state_dict={"iteration": 1}) is None


def _write_megatron_019_checkpoint(directory, weight, common):
    """0.19's layout from PyTorch's own DCP writer (with Megatron's planner, which stores BytesIO values as their
    bytes): tensors, the common_state bytes, a two-field metadata.json."""
    buffer = io.BytesIO()
    torch.save([common], buffer)
    buffer.seek(0)
    dcp.save(
        {"w": weight, "common_state/shard_0_1": buffer},
        checkpoint_id=str(directory),
        no_dist=True,
        planner=MCoreSavePlanner(),
    )
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')


def test_a_checkpoint_without_common_pt_written_by_another_dcp_writer_loads(tmp_path):
    weight = torch.randn(4, 3)
    _write_megatron_019_checkpoint(tmp_path, weight, COMMON)
    loaded = load(_request(), tmp_path, strict="raise_all")  # common_state is not an unrequested key
    assert torch.equal(loaded["w"], weight)
    assert {k: loaded[k] for k in COMMON} == COMMON
    assert load_common_state_dict(tmp_path) == COMMON


# Written by megatron-core 0.19.2 itself (its dist_checkpointing.save, one gloo rank) from this state:
# "embedding.weight" = arange(12).reshape(4, 3); "decoder.layers.bias" = two [3] layers stacked on a prepended axis,
# layer i full of i; ShardedObject "rng_state" (1, 1) = [{"seed": 5}]; common state args=Namespace(lr=0.5,
# tensor_model_parallel_size=1), iteration=42, checkpoint_version=3.0.
MEGATRON_019_CHECKPOINT = Path(__file__).parent / "data" / "megatron_core_0_19_2"


def test_a_checkpoint_written_by_megatron_core_0_19_loads(tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(MEGATRON_019_CHECKPOINT, checkpoint)  # loading writes nothing, but keep the fixture pristine
    assert sorted(os.listdir(checkpoint)) == [".metadata", "__0_0.distcp", "metadata.json"]  # no common.pt
    request = {
        "w": ShardedTensor.from_rank_offsets("embedding.weight", torch.zeros(4, 3)),
        "layers": [
            ShardedTensor.from_rank_offsets("decoder.layers.bias", torch.zeros(3), (0, i, 2), prepend_axis_num=1)
            for i in range(2)
        ],
        "rng_state": ShardedObject("rng_state", None, (1, 1), (0, 0)),
    }
    loaded = load(request, checkpoint, strict="raise_all")
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(4, 3))
    assert [t.tolist() for t in loaded["layers"]] == [[0.0] * 3, [1.0] * 3]
    assert loaded["rng_state"] == [{"seed": 5}]
    assert loaded["args"] == argparse.Namespace(lr=0.5, tensor_model_parallel_size=1)
    assert (loaded["iteration"], loaded["checkpoint_version"]) == (42, 3.0)
    # Megatron-Core 0.19 also pickles every rank's save plan into .metadata; the allow-list admits those records.
    assert read_dcp_metadata(checkpoint).all_local_plans
    # Resharded: two "tensor-parallel" halves of the embedding, read by one process.
    halves = [ShardedTensor.from_rank_offsets("embedding.weight", torch.zeros(2, 3), (0, i, 2)) for i in range(2)]
    parts = load({"h": halves}, checkpoint, validate_access_integrity=False)["h"]
    assert torch.equal(torch.cat(parts), torch.arange(12.0).reshape(4, 3))


def test_a_legacy_checkpoint_with_common_pt_loads(tmp_path):
    weight = torch.randn(4, 3)
    dcp.save({"w": weight}, checkpoint_id=str(tmp_path), no_dist=True)
    torch.save(COMMON, tmp_path / "common.pt")  # how earlier versions (and Megatron before 0.19) stored it
    (tmp_path / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", '
        '"common_backend_version": 1}'
    )
    loaded = load(_request(), tmp_path)
    assert torch.equal(loaded["w"], weight) and loaded["args"] == COMMON["args"]
    assert load_common_state_dict(tmp_path) == COMMON


def test_saving_over_a_legacy_checkpoint_removes_its_common_pt(tmp_path):
    torch.save({"iteration": 1}, tmp_path / "common.pt")
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 3)), "iteration": 2}, tmp_path)
    assert not (tmp_path / "common.pt").exists() and load_common_state_dict(tmp_path)["iteration"] == 2


def test_the_common_state_key_is_reserved(tmp_path):
    with pytest.raises(CheckpointingException, match="the key 'common_state' is reserved"):
        save({"x": ShardedObject("common_state", 1, (1,), (0,))}, tmp_path)


def _corrupt_common_state(directory):
    metadata = read_dcp_metadata(directory)
    (index,) = [i for i in metadata.storage_data if i.fqn == "common_state/shard_0_1"]
    info = metadata.storage_data[index]
    path = directory / info.relative_path
    content = bytearray(path.read_bytes())
    content[info.offset : info.offset + info.length] = b"\x00" * info.length
    path.write_bytes(bytes(content))
    return path


def test_a_corrupt_common_state_entry_names_the_checkpoint(tmp_path):
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 3)), **COMMON}, tmp_path)
    path = _corrupt_common_state(tmp_path)
    pattern = (
        rf"rank 0 could not read {path}: ShardedObject 'common_state/shard_0_1' in {path} of checkpoint {tmp_path} "
        r"is corrupt or truncated \(.*\)\. The checkpoint .* is damaged; load an earlier checkpoint"
    )
    with pytest.raises(CheckpointingException, match=rf"{path} is corrupt: bytes \d+-\d+ \(of \d+\) do not match"):
        load_common_state_dict(tmp_path)
    # Without the checksums, the damaged pickle is still reported, naming the checkpoint.
    with verification(False):
        with pytest.raises(CheckpointingException, match=pattern):
            load_common_state_dict(tmp_path)
        with pytest.raises(CheckpointingException, match=rf"loading checkpoint {tmp_path} failed .*{pattern}"):
            load(_request(), tmp_path)


def test_a_checkpoint_with_no_common_state_at_all_says_so(tmp_path):
    dcp.save({"w": torch.ones(4, 3)}, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    with pytest.raises(
        CheckpointingException,
        match=rf"the checkpoint {tmp_path} has no common state: neither 'common_state/shard_0_1' in its sharded "
        "files nor a legacy common.pt",
    ):
        load_common_state_dict(tmp_path)


# ---- GPT + optimizer + RNG round trip at TP1, TP2, PP2 -----------------------------------------------------------

LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2)}  # name: (ranks, tp, pp)


def _rng_object():
    """What the training application saves: every RNG's state, one object per (pp, tp) rank, replicated over DP."""
    from megatron.core import parallel_state, tensor_parallel

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        [state],
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def _after_save_or_load(chunks, optimizer):
    """The weights, the next RNG draws and the next two training losses."""
    return {
        "weights": helpers.full_weights(chunks),
        "draws": _draws(),
        "losses": helpers.train(chunks, optimizer, [1, 2]),
    }


def _round_trip(directory, tp, pp):
    import torch.distributed as dist

    chunks, optimizer = helpers.build_chunks(tp, pp, seed=1)
    helpers.train(chunks, optimizer, [0])
    random.seed(7 + dist.get_rank())
    np.random.seed(7)
    torch.manual_seed(7)
    state = helpers.checkpoint_state_dict(chunks, optimizer)
    state["rng_state"] = _rng_object()
    state.update(args=argparse.Namespace(tensor_model_parallel_size=tp, rank=dist.get_rank()), iteration=1)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    save(state, directory, preprocess_common_before_consistancy_check=lambda common: {"iteration": common["iteration"]})
    expected = _after_save_or_load(chunks, optimizer)

    chunks, optimizer = helpers.build_chunks(tp, pp, seed=2)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    request = helpers.checkpoint_state_dict(chunks, optimizer, is_loading=True)
    request["rng_state"] = _rng_object()
    loaded = load(request, directory)
    helpers.load_into(chunks, optimizer, loaded)
    (rng,) = loaded["rng_state"]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    got = _after_save_or_load(chunks, optimizer)
    return expected, got, (loaded["iteration"], loaded["args"].rank), sorted(os.listdir(directory))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_gpt_with_optimizer_and_rng_round_trips(tmp_path, name):
    ranks, tp, pp = LAYOUTS[name]
    for rank, (expected, got, common, files) in enumerate(run_distributed(ranks, _round_trip, tmp_path / name, tp, pp)):
        assert "common.pt" not in files
        assert common == (1, 0)  # rank 0's common state is the saved one
        assert got["draws"] == expected["draws"], f"rank {rank}: RNG state not restored"
        assert got["losses"] == expected["losses"], f"rank {rank}: optimizer state not restored"
        assert got["weights"].keys() == expected["weights"].keys()
        assert all(torch.equal(got["weights"][k], v) for k, v in expected["weights"].items())
