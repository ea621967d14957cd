"""ShardedTensor / ShardedObject / factories: metadata arithmetic and every construction error."""

import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import (
    diff,
    dict_list_map_inplace,
    extract_matching_values,
    merge,
    nested_values,
)
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from megatron.core.dist_checkpointing.utils import (
    add_prefix_for_sharding,
    apply_prefix_mapping,
    extract_nonpersistent,
    extract_sharded_tensors,
    extract_sharded_tensors_and_factories,
    replace_prefix_for_sharding,
)


def test_from_rank_offsets_places_the_piece_on_the_grid():
    piece = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (1, 1, 4), (2, 1, 2), prepend_axis_num=1)
    assert piece.local_shape == (2, 3)
    assert piece.global_shape == (1, 8, 6)
    assert piece.global_offset == (0, 2, 3)
    assert piece.axis_fragmentations == (1, 4, 2)
    assert piece.global_slice() == (0, slice(2, 4), slice(3, 6))
    assert piece.local_chunk_offset_in_global() == (0, 1, 1)


def test_prepended_axis_is_indexed_by_integer():
    layer = ShardedTensor.from_rank_offsets("layers.w", torch.zeros(4), (0, 3, 5), prepend_axis_num=1)
    assert layer.global_shape == (5, 4)
    assert layer.global_slice() == (3, slice(0, 4))


def test_from_rank_offsets_flat_keeps_the_non_flat_geometry():
    flat = ShardedTensor.from_rank_offsets_flat(
        "w", torch.zeros(5), (2, 3), (0, 1, 2), flattened_range=slice(1, 6), replica_id=(0, 1)
    )
    assert flat.local_shape == (2, 3) and flat.global_shape == (4, 3) and flat.global_offset == (2, 0)
    assert flat.flattened_range == slice(1, 6) and not is_main_replica(flat.replica_id)


@pytest.mark.parametrize(
    "rank_offsets, match",
    [
        (((0, 0, 2), (0, 1, 2)), "axis 0 is listed twice"),
        (((0, 2, 2),), r"rank offset 2 on axis 0 must lie in \[0, 2\)"),
        (((3, 0, 2),), "axis 3 does not exist"),
    ],
)
def test_from_rank_offsets_rejects_bad_offsets(rank_offsets, match):
    with pytest.raises(CheckpointingException, match=match):
        ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2), *rank_offsets)


def test_from_rank_offsets_refuses_a_flattened_range():
    with pytest.raises(CheckpointingException, match="use from_rank_offsets_flat"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=slice(0, 2))


@pytest.mark.parametrize(
    "data, shape, kwargs, match",
    [
        (torch.zeros(4), (2, 3), {}, "needs a flattened_range"),
        (torch.zeros(2, 2), (2, 3), {"flattened_range": slice(0, 4)}, "flat data must be 1-D"),
        (torch.zeros(4), (2, 3), {"flattened_range": slice(0, 5)}, "must be 1-D with 5 elements"),
        (torch.zeros(4), (2, 3), {"flattened_range": slice(4, 8)}, r"inside \[0, 6\)"),
    ],
)
def test_from_rank_offsets_flat_rejects_inconsistent_ranges(data, shape, kwargs, match):
    with pytest.raises(CheckpointingException, match=match):
        ShardedTensor.from_rank_offsets_flat("w", data, shape, **kwargs)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"global_offset": (0,)}, "must have the same number of axes"),
        ({"local_shape": (2,), "global_shape": (4, 2), "global_offset": (0, 0)}, "plus prepend_axis_num=0"),
        ({"global_offset": (1, 0)}, "not a multiple of the local size 2"),
        ({"global_offset": (4, 0)}, "lies outside the global shape"),
        ({"dtype": torch.float16}, "data dtype torch.float32 differs from dtype torch.float16"),
        (
            {"local_shape": (3, 2), "global_shape": (6, 2), "global_offset": (3, 0)},
            r"data shape \(2, 2\) differs from local_shape \(3, 2\)",
        ),
    ],
)
def test_inconsistent_fields_are_rejected(fields, match):
    base = dict(
        key="w",
        data=torch.zeros(2, 2),
        dtype=torch.float32,
        local_shape=(2, 2),
        global_shape=(4, 2),
        global_offset=(2, 0),
        axis_fragmentations=(2, 1),
    )
    base.update(fields)
    with pytest.raises(CheckpointingException, match=match):
        ShardedTensor(**base)


def test_uneven_pieces_are_allowed_without_axis_fragmentations():
    piece = ShardedTensor("w", torch.zeros(3, 2), torch.float32, (3, 2), (5, 2), (1, 0), None)
    assert not piece.has_regular_grid


def test_init_data_allocates_the_in_memory_shape():
    flat = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 3), flattened_range=slice(1, 5))
    flat = flat.without_data()
    flat.init_data("cpu")
    assert flat.data.shape == (4,)


def test_sharded_object_unique_key_round_trips():
    obj = ShardedObject("rng_state", 42, (2, 4), (1, 3), replica_id=(0, 1))
    assert obj.unique_key == "rng_state/shard_1.3_2.4"
    again = ShardedObject.empty_from_unique_key(obj.unique_key)
    assert (again.key, again.global_shape, again.global_offset, again.data) == ("rng_state", (2, 4), (1, 3), None)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ShardedObject("o", 1, (2,), (0, 0)), "must have the same number of axes"),
        (lambda: ShardedObject("o", 1, (2,), (2,)), "lies outside global_shape"),
        (lambda: ShardedObject.empty_from_unique_key("o/shard_1"), "is not a ShardedObject key"),
    ],
)
def test_sharded_object_errors(make, match):
    with pytest.raises(CheckpointingException, match=match):
        make()


def _split_rows(key, data, replica_id, flattened_range):
    halves = data.chunk(2)
    return {
        "top": ShardedTensor.from_rank_offsets(f"{key}.top", halves[0], replica_id=replica_id),
        "bottom": ShardedTensor.from_rank_offsets(f"{key}.bottom", halves[1], replica_id=replica_id),
    }


def _join_rows(loaded):
    return torch.cat([loaded["top"], loaded["bottom"]])


def test_factories_build_and_merge_back():
    data = torch.arange(8.0).view(4, 2)
    state = {"a": [ShardedTensorFactory("fused", data, _split_rows, _join_rows)], "b": 1}
    factories, _ = extract_matching_values(
        state, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(state)
    assert sorted(sh.key for sh in nested_values(state["a"])) == ["fused.bottom", "fused.top"]
    loaded = {"a": [{"top": data[:2], "bottom": data[2:]}], "b": 1}
    merged = apply_factory_merges(loaded, factories)
    assert torch.equal(merged["a"][0], data)


def test_factory_merge_without_its_pieces_names_the_place():
    factory = ShardedTensorFactory("fused", torch.zeros(2), _split_rows, _join_rows)
    with pytest.raises(CheckpointingException, match=r"nothing at \('x',\)"):
        apply_factory_merges({}, {"x": factory})


def test_local_nonpersistent_object_unwraps():
    assert LocalNonpersistentObject([1, 2]).unwrap() == [1, 2]


def test_extract_matching_values_keeps_nesting_and_empty_containers():
    state = {"a": {"t": 1, "s": "x"}, "l": [1, "y", 2], "empty": {}}
    ints, rest = extract_matching_values(state, lambda v: isinstance(v, int))
    assert ints == {"a": {"t": 1}, "l": [1, 2]}
    assert rest == {"a": {"s": "x"}, "l": ["y"], "empty": {}}
    ints, _ = extract_matching_values(state, lambda v: isinstance(v, int), return_lists_as_dicts=True)
    assert ints["l"] == {0: 1, 2: 2}
    with pytest.raises(TypeError, match="expects a dict or a list"):
        extract_matching_values(3, bool)


def test_merge_diff_and_map():
    merged = merge({"a": [1, 2], "b": {"c": 1}}, {"a": {1: 5}, "b": {"d": 2}})
    assert merged == {"a": [1, 5], "b": {"c": 1, "d": 2}}
    with pytest.raises(ValueError, match="cannot merge index 3"):
        merge([1], {3: 1})
    left, right, mismatch = diff({"a": torch.ones(2), "b": 1}, {"a": torch.zeros(2), "c": 1})
    assert (left, right, mismatch) == ([("b",)], [("c",)], [("a",)])
    doubled = dict_list_map_inplace(lambda v: v * 2, {"a": [1, {"b": 2}]})
    assert doubled == {"a": [2, {"b": 4}]}


def _state():
    return {
        "w": ShardedTensor.from_rank_offsets("decoder.input_layernorm.weight", torch.zeros(2)),
        "o": ShardedObject("decoder.rng", 1, (1,), (0,)),
        "n": LocalNonpersistentObject(3),
        "f": ShardedTensorFactory("decoder.fc1", torch.zeros(2), _split_rows, _join_rows),
    }


def test_prefix_helpers_rename_every_sharded_leaf():
    state = _state()
    apply_prefix_mapping(state, {"decoder.input_layernorm.": "decoder.self_attention.linear_qkv.layer_norm_"})
    assert state["w"].key == "decoder.self_attention.linear_qkv.layer_norm_weight"
    replace_prefix_for_sharding(state, "decoder.", "model.decoder.")
    assert {state["w"].key, state["o"].key, state["f"].key} == {
        "model.decoder.self_attention.linear_qkv.layer_norm_weight",
        "model.decoder.rng",
        "model.decoder.fc1",
    }
    add_prefix_for_sharding(state, "x.")
    assert state["o"].key == "x.model.decoder.rng"
    with pytest.raises(ValueError, match="does not start with the prefix 'y.'"):
        replace_prefix_for_sharding(state, "y.", "z.")


def test_extract_helpers_split_by_type():
    tensors, rest = extract_sharded_tensors(_state())
    assert list(tensors) == ["w"] and sorted(rest) == ["f", "n", "o"]
    with_factories, _ = extract_sharded_tensors_and_factories(_state())
    assert sorted(with_factories) == ["f", "w"]
    nonpersistent, _ = extract_nonpersistent(_state())
    assert list(nonpersistent) == ["n"]


def test_narrow_cuts_every_piece_the_same_way():
    piece = ShardedTensor.from_rank_offsets("w", torch.arange(2 * 3 * 4).reshape(2, 3, 4), (0, 1, 5), (2, 2, 3))
    (whole_axis,) = piece.narrow(1, 1, 2)
    assert (whole_axis.local_shape, whole_axis.global_shape, whole_axis.global_offset) == (
        (2, 2, 4),
        (10, 2, 12),
        (2, 0, 8),
    )
    assert torch.equal(whole_axis.data, piece.data[:, 1:3])
    (split_axis,) = piece.narrow(2, 1, 3)
    assert (split_axis.global_shape, split_axis.global_offset) == ((10, 3, 9), (2, 0, 6))
    assert piece.without_data().narrow(0, 0, 1)[0].data is None


def test_narrow_errors_name_the_tensor_and_the_problem():
    piece = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (1, 1, 2))
    with pytest.raises(CheckpointingException, match=r"'w': narrow\(\) axis 2 does not exist"):
        piece.narrow(2, 0, 1)
    with pytest.raises(CheckpointingException, match=r"'w': narrow\(1, 3, 2\) leaves the local size 4"):
        piece.narrow(1, 3, 2)
    uneven = ShardedTensor("u", torch.zeros(3), torch.float32, (3,), (5,), (0,), None)
    with pytest.raises(CheckpointingException, match="'u': narrow\\(\\) on axis 0, which is split into uneven"):
        uneven.narrow(0, 0, 2)
    flat = ShardedTensor.from_rank_offsets_flat("f", torch.zeros(2), (2, 2), flattened_range=slice(0, 2))
    with pytest.raises(CheckpointingException, match="'f': narrow\\(\\) cuts whole pieces"):
        flat.narrow(0, 0, 1)
