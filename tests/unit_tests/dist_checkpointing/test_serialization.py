"""save/load on one process: what is written, what comes back, and the helpers that read checkpoint metadata."""

import io
import json
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    check_is_distributed_checkpoint,
    load,
    load_common_state_dict,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    save,
)
from tests.unit_tests.dist_checkpointing.dcp_file_helpers import load_plain_objects


def _split_rows(key, data, replica_id, flattened_range):
    top, bottom = data.chunk(2)
    return {
        "top": ShardedTensor.from_rank_offsets(f"{key}.top", top, replica_id=replica_id),
        "bottom": ShardedTensor.from_rank_offsets(f"{key}.bottom", bottom, replica_id=replica_id),
    }


def _join_rows(loaded):
    return torch.cat([loaded["top"], loaded["bottom"]])


def _model_state(weight, layers, fused, rng):
    return {
        "model": {
            "embedding": ShardedTensor.from_rank_offsets("embedding.weight", weight),
            "layers": [
                ShardedTensor.from_rank_offsets("decoder.layers.bias", layer, (0, i, len(layers)), prepend_axis_num=1)
                for i, layer in enumerate(layers)
            ],
            "fused": ShardedTensorFactory("decoder.fc1", fused, _split_rows, _join_rows),
        },
        "rng_state": ShardedObject("rng_state", rng, (1,), (0,)),
        "iteration": 7,
        "args": {"lr": 0.1},
        "scratch": LocalNonpersistentObject("not saved"),
    }


def _saved(tmp_path):
    weight = torch.randn(6, 4)
    layers = [torch.randn(3), torch.randn(3)]
    fused = torch.randn(4, 2)
    save(_model_state(weight, layers, fused, {"seed": 5}), tmp_path)
    return weight, layers, fused


def test_round_trip_restores_every_kind_of_leaf(tmp_path):
    weight, layers, fused = _saved(tmp_path)
    request = _model_state(torch.zeros(6, 4), [torch.zeros(3), torch.zeros(3)], torch.zeros(4, 2), None)
    request["scratch"] = LocalNonpersistentObject("local value")
    loaded = load(request, tmp_path)
    assert torch.equal(loaded["model"]["embedding"], weight)
    assert [torch.equal(a, b) for a, b in zip(loaded["model"]["layers"], layers)] == [True, True]
    assert torch.equal(loaded["model"]["fused"], fused)
    assert loaded["rng_state"] == {"seed": 5}
    assert (loaded["iteration"], loaded["args"], loaded["scratch"]) == (7, {"lr": 0.1}, "local value")
    # The request is untouched: its factory is still a factory, its tensors still ShardedTensors.
    assert isinstance(request["model"]["fused"], ShardedTensorFactory)


def test_load_fills_the_given_tensors_in_place_or_allocates(tmp_path):
    weight, _, _ = _saved(tmp_path)
    target = torch.zeros(6, 4)
    loaded = load({"a": ShardedTensor.from_rank_offsets("embedding.weight", target)}, tmp_path)
    assert loaded["a"] is target and torch.equal(target, weight)
    empty = ShardedTensor.from_rank_offsets("embedding.weight", torch.zeros(3, 4), (0, 1, 2)).without_data()
    assert torch.equal(load({"a": empty}, tmp_path, validate_access_integrity=False)["a"], weight[3:])


def test_files_are_megatron_torch_dist_layout(tmp_path):
    _saved(tmp_path)
    assert {".metadata", "metadata.json"} <= set(os.listdir(tmp_path)) and "common.pt" not in os.listdir(tmp_path)
    assert any(name.startswith("__0_") and name.endswith(".distcp") for name in os.listdir(tmp_path))
    config = json.loads((tmp_path / "metadata.json").read_text())
    assert config == {"sharded_backend": "torch_dist", "sharded_backend_version": 1}  # Megatron-Core 0.19's fields
    metadata = FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    assert sorted(metadata) == [
        "common_state/shard_0_1",
        "decoder.fc1.bottom",
        "decoder.fc1.top",
        "decoder.layers.bias",
        "embedding.weight",
        "rng_state/shard_0_1",
    ]
    stacked = metadata["decoder.layers.bias"]
    assert tuple(stacked.size) == (2, 3)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in stacked.chunks] == [((0, 0), (1, 3)), ((1, 0), (1, 3))]
    # The common state is stored like every ShardedObject: the bytes of torch.save([state]).
    common = load_plain_objects(tmp_path)["common_state/shard_0_1"]
    assert common == [{"iteration": 7, "args": {"lr": 0.1}}]


def test_pytorch_dcp_tools_read_the_checkpoint(tmp_path):
    weight, layers, _ = _saved(tmp_path)
    dcp_to_torch_save(tmp_path, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert torch.equal(plain["embedding.weight"], weight)
    assert torch.equal(plain["decoder.layers.bias"], torch.stack(layers))


def test_metadata_helpers(tmp_path):
    weight, layers, fused = _saved(tmp_path)
    assert check_is_distributed_checkpoint(tmp_path) and not check_is_distributed_checkpoint(tmp_path / "x")
    metadata = load_tensors_metadata(tmp_path)
    assert metadata["decoder.layers.bias"].global_shape == (2, 3)
    assert metadata["embedding.weight"].dtype == torch.float32
    assert "rng_state/shard_0_1" in load_sharded_metadata(tmp_path)
    plain = load_plain_tensors(tmp_path)
    assert torch.equal(plain["decoder.fc1.top"], fused[:2]) and torch.equal(plain["decoder.layers.bias"][1], layers[1])
    assert load_common_state_dict(tmp_path) == {"iteration": 7, "args": {"lr": 0.1}}


def test_bf16_and_scalar_tensors(tmp_path):
    values = torch.randn(3, 5).to(torch.bfloat16)
    scalar = torch.tensor(2.5)
    state = {"v": ShardedTensor.from_rank_offsets("v", values), "s": ShardedTensor.from_rank_offsets("s", scalar)}
    save(state, tmp_path)
    loaded = load(
        {
            "v": ShardedTensor.from_rank_offsets("v", torch.zeros(3, 5, dtype=torch.bfloat16)),
            "s": ShardedTensor.from_rank_offsets("s", torch.tensor(0.0)),
        },
        tmp_path,
    )
    assert torch.equal(loaded["v"], values) and loaded["s"].item() == 2.5


@pytest.mark.parametrize("rows", [4, 8])
def test_allow_shape_mismatch_reads_the_overlap_and_zeroes_the_rest(tmp_path, rows):
    saved = torch.arange(12.0).view(6, 2)
    save({"e": ShardedTensor.from_rank_offsets("embedding", saved)}, tmp_path)
    target = torch.full((rows, 2), -1.0)
    request = ShardedTensor.from_rank_offsets("embedding", target, allow_shape_mismatch=True)
    load({"e": request}, tmp_path)
    kept = min(rows, 6)
    assert torch.equal(target[:kept], saved[:kept]) and not target[kept:].any()


def test_save_over_an_existing_checkpoint_replaces_it(tmp_path):
    save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path)
    save({"b": ShardedTensor.from_rank_offsets("b", torch.full((2,), 3.0))}, tmp_path)
    assert list(load_tensors_metadata(tmp_path)) == ["b"]
    assert load_plain_tensors(tmp_path)["b"].tolist() == [3.0, 3.0]


def test_strategy_tuples_and_unknown_backends(tmp_path):
    save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path, sharded_strategy=("torch_dist", 1))
    with pytest.raises(dist_checkpointing.CheckpointingException, match="no save_sharded strategy for backend 'zarr'"):
        save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path, sharded_strategy=("zarr", 1))


def test_factory_building_a_list_gets_its_pieces_back_as_a_list(tmp_path):
    # The factory sits in a list and builds a list: merge_fn must see [piece, piece, piece], not {0: .., 1: ..}.
    def build(key, data, replica_id, flattened_range):
        return [ShardedTensor.from_rank_offsets(f"{key}.{i}", data + i, replica_id=replica_id) for i in range(3)]

    def merge_pieces(pieces):
        assert isinstance(pieces, list), pieces
        return torch.stack(pieces)

    def request(base):
        return {
            "all": [
                ShardedTensor.from_rank_offsets("a", torch.arange(2) + base),
                ShardedTensorFactory("f", torch.arange(4) + base, build, merge_pieces),
            ]
        }

    save(request(0), tmp_path)
    loaded = load(request(10), tmp_path)
    assert torch.equal(loaded["all"][0], torch.arange(2))
    assert torch.equal(loaded["all"][1], torch.stack([torch.arange(4) + i for i in range(3)]))


def test_sharded_object_holding_serialized_bytes_round_trips(tmp_path):
    # io.BytesIO is on the allow-list (as in Megatron-Core): an object stored as bytes loads back as a BytesIO.
    buffer = io.BytesIO()
    torch.save({"some": "dict"}, buffer)
    save({"obj": ShardedObject("blob", buffer, (1,), (0,))}, tmp_path)
    loaded = load({"obj": ShardedObject("blob", io.BytesIO(), (1,), (0,))}, tmp_path)
    loaded["obj"].seek(0)
    assert torch.load(loaded["obj"], weights_only=True) == {"some": "dict"}
