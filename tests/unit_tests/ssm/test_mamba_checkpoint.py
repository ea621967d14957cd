"""A Mamba layer's checkpoint has Megatron-Core 0.19's keys and shapes, does not depend on TP, and reshards."""

import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.ssm.mamba_mixer import _tp_part, split_tensor_factory
from tests.unit_tests.ssm import mamba_test_helpers as helpers
from tests.unit_tests.test_utilities import run_distributed

PREFIX = "decoder.layers.3."
D_INNER, GROUPS_X_STATE, NHEADS, HIDDEN = 32, 4 * 8, 8, helpers.HIDDEN
EXPECTED = {
    "mixer.in_proj.layer_norm_weight": (HIDDEN,),
    "mixer.in_proj.weight.z": (D_INNER, HIDDEN),
    "mixer.in_proj.weight.x": (D_INNER, HIDDEN),
    "mixer.in_proj.weight.B": (GROUPS_X_STATE, HIDDEN),
    "mixer.in_proj.weight.C": (GROUPS_X_STATE, HIDDEN),
    "mixer.in_proj.weight.dt": (NHEADS, HIDDEN),
    "mixer.in_proj._extra_state": None,
    "mixer.conv1d.weight.x": (D_INNER, 1, 4),
    "mixer.conv1d.weight.B": (GROUPS_X_STATE, 1, 4),
    "mixer.conv1d.weight.C": (GROUPS_X_STATE, 1, 4),
    "mixer.conv1d.bias.x": (D_INNER,),
    "mixer.conv1d.bias.B": (GROUPS_X_STATE,),
    "mixer.conv1d.bias.C": (GROUPS_X_STATE,),
    "mixer.A_log": (NHEADS,),
    "mixer.D": (NHEADS,),
    "mixer.dt_bias": (NHEADS,),
    "mixer.norm.weight": (D_INNER,),
    "mixer.out_proj.weight": (HIDDEN, D_INNER),
    "mixer.out_proj._extra_state": None,
}


def _leaves(sharded_state_dict):
    for value in sharded_state_dict.values():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield value


def _keys_and_shapes(tp):
    layer = helpers.build_layer(tp, seed=1)
    sharded = layer.sharded_state_dict(prefix=PREFIX)
    apply_factories(sharded)
    found = {}
    for leaf in _leaves(sharded):
        if isinstance(leaf, ShardedObject):
            found[leaf.key] = None
        else:
            assert isinstance(leaf, ShardedTensor)
            found[leaf.key] = leaf.global_shape
    return found


def test_checkpoint_keys_and_global_shapes_are_megatrons_at_every_tp():
    expected = {PREFIX + key: shape for key, shape in EXPECTED.items()}
    for tp in (1, 2):
        for found in run_distributed(tp, _keys_and_shapes, tp):
            assert found == expected, f"TP={tp}"


def _whole_layer(layer):
    weights = {"norm.weight": layer.norm.weight.detach().clone()}
    weights.update({f"mixer.{name}": value for name, value in helpers.whole_parameters(layer.mixer).items()})
    return weights


def _layer_output(layer):
    x = torch.randn(helpers.SEQ, helpers.BATCH, helpers.HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return layer(x)


def _save(tp, directory):
    layer = helpers.build_layer(tp, seed=1, chunk_size=5)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            # The same whole perturbation on every TP layout: drawn whole, added to this rank's part.
            whole = helpers.whole(layer.mixer, name[len("mixer.") :], param) if name.startswith("mixer.") else param
            noise = torch.randn(whole.shape, generator=generator)
            if name.startswith("mixer."):
                param.copy_(_local_part(layer.mixer, name[len("mixer.") :], whole + noise))
            else:
                param.add_(noise)
    dist_checkpointing.save(layer.sharded_state_dict(prefix=PREFIX), directory)
    return _whole_layer(layer), _layer_output(layer)


def _local_part(mixer, name, whole):
    if name.startswith("in_proj.weight") or name.startswith("in_proj.bias"):
        return _tp_part(whole, mixer.in_proj_sections, mixer.tp_rank, mixer.tp_size)
    if name.startswith("conv1d."):
        return _tp_part(whole, mixer.conv_sections, mixer.tp_rank, mixer.tp_size)
    if name == "out_proj.weight":
        return whole.chunk(mixer.tp_size, dim=1)[mixer.tp_rank]
    return whole.chunk(mixer.tp_size, dim=0)[mixer.tp_rank]


def _load(tp, directory):
    layer = helpers.build_layer(tp, seed=9, chunk_size=5)
    before = _whole_layer(layer)
    loaded = dist_checkpointing.load(layer.sharded_state_dict(prefix=PREFIX), directory)
    layer.load_state_dict({key[len(PREFIX) :]: value for key, value in loaded.items()})
    return before, _whole_layer(layer), _layer_output(layer)


def test_saved_at_tp2_loads_at_tp1_and_tp4(tmp_path):
    saved_weights, saved_output = run_distributed(2, _save, 2, tmp_path)[0]
    for tp in (1, 4):
        for before, weights, output in run_distributed(tp, _load, tp, tmp_path):
            assert weights.keys() == saved_weights.keys()
            for name, value in saved_weights.items():
                assert not torch.equal(before[name], value), f"{name} was already equal before loading"
                assert torch.equal(weights[name], value), f"{name} at TP={tp}"
            torch.testing.assert_close(output, saved_output, rtol=1e-5, atol=1e-6)


def test_split_factory_stores_flat_shards_of_each_segment():
    """The distributed optimizer hands the factory flat slices of the local tensor: each slice is stored as the
    slices of the segments it overlaps, at the right place of each segment's global tensor, and merges back."""
    sections, names, row = [3, 3, 2], ["x", "B", "C"], 4  # this rank's rows of each segment; 4 values per row
    tp_rank, tp_size = 1, 2
    local = torch.arange(8 * row, dtype=torch.float32).view(8, 1, row)
    original = ShardedTensor.from_rank_offsets("w", local, (0, 2, 5), (1, tp_rank, tp_size), prepend_axis_num=1)
    whole_pieces = split_tensor_factory(original, sections, names).build()
    assert {name: piece.global_shape for name, piece in whole_pieces.items()} == {
        "x": (5, 6, 1, row),
        "B": (5, 6, 1, row),
        "C": (5, 4, 1, row),
    }
    assert whole_pieces["B"].global_offset == (2, 3, 0, 0)
    assert torch.equal(whole_pieces["B"].data, local[3:6])
    flat = local.flatten()
    for start, stop in ((0, 10), (10, 27), (27, 32)):
        factory = split_tensor_factory(original, sections, names)
        factory.data, factory.flattened_range = flat[start:stop], slice(start, stop)
        pieces = factory.build()
        for name, piece in pieces.items():
            first_row = sum(sections[: names.index(name)])
            segment = local[first_row : first_row + sections[names.index(name)]].flatten()
            assert torch.equal(piece.data, segment[piece.flattened_range]), (start, name)
            assert piece.key == f"w.{name}" and piece.local_shape == (sections[names.index(name)], 1, row)
        assert torch.equal(factory.merge_fn({name: piece.data for name, piece in pieces.items()}), flat[start:stop])
