"""sharded_state_dict of GPTModel and of the optimizers: Megatron's checkpoint keys (a golden list), pieces that tile
every global tensor exactly once whatever the TP/PP/VPP/DP layout, optimizer state keyed like its parameters, and the
errors. No storage is involved here (see test_model_resharding.py for save/load)."""

import math
from pathlib import Path

import pytest
import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica
from megatron.core.dist_checkpointing.optimizer import extract_common_step, make_sharded_optimizer_tensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from tests.unit_tests.dist_checkpointing import gpt_checkpoint_helpers as helpers
from tests.unit_tests.models.gpt_test_helpers import VARIANTS
from tests.unit_tests.test_utilities import run_distributed

GOLDEN = Path(__file__).with_name("golden_gpt_local_spec_keys.txt")

# section name -> (config overrides, model kwargs); every model has NUM_LAYERS layers
GOLDEN_MODELS = {
    "gpt: LayerNorm, GELU, biases, learned absolute positions, untied output layer": (
        {**VARIANTS["gpt2"]["config"], "add_bias_linear": True},
        {"position_embedding_type": "learned_absolute", "share_embeddings_and_output_weights": False},
    ),
    "llama: RMSNorm, SwiGLU, grouped-query attention, no biases, rotary positions, untied output layer": (
        VARIANTS["llama"]["config"],
        {"position_embedding_type": "rope", "share_embeddings_and_output_weights": False},
    ),
    "tied: RMSNorm, SwiGLU with biases, grouped-query attention, rotary positions, tied output layer": (
        helpers.CHECKPOINT_VARIANT,
        helpers.CHECKPOINT_MODEL_KWARGS,
    ),
}
TIED_SECTION = next(name for name in GOLDEN_MODELS if name.startswith("tied"))


def key_listing(pieces) -> list:
    """``<key> <tensor|object> [global shape]`` per checkpoint key, sorted."""
    shapes = {}
    for kind, key, global_shape, *_ in pieces:
        assert shapes.setdefault(key, (kind, global_shape)) == (kind, global_shape), f"{key}: pieces disagree"
    return [f"{key} {kind} {list(shape)}" for key, (kind, shape) in sorted(shapes.items())]


def read_golden() -> dict:
    sections, current = {}, None
    for line in GOLDEN.read_text().splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif line and not line.startswith("#"):
            current.append(line)
    return sections


def _single_rank_pieces():
    results = {}
    for name, (config, model_kwargs) in GOLDEN_MODELS.items():
        chunks, _ = helpers.build_chunks(1, 1, variant_config=config, model_kwargs=model_kwargs)
        model = helpers.gpt_model(chunks[0])
        sharded = chunks[0].sharded_state_dict()
        results[name] = {
            "pieces": helpers.describe_pieces(sharded),
            "dict_keys": sorted(sharded),
            "state_dict_keys": sorted(model.state_dict()),
        }
    return results


@pytest.fixture(scope="module")
def single_rank():
    return run_distributed(1, _single_rank_pieces)[0]


def test_checkpoint_keys_match_the_golden_list(single_rank):
    golden = read_golden()
    assert sorted(golden) == sorted(GOLDEN_MODELS), f"sections of {GOLDEN.name} differ from the models tested"
    for name in GOLDEN_MODELS:
        actual = key_listing(single_rank[name]["pieces"])
        assert actual == golden[name], f"[{name}] keys differ from {GOLDEN.name}; got:\n" + "\n".join(actual)


def test_dict_keys_are_the_state_dict_names_so_a_loaded_dict_loads_into_the_model(single_rank):
    for name, result in single_rank.items():
        # The output layer's empty extra state is not stored (as in Megatron); the layer tolerates its absence.
        expected = [key for key in result["state_dict_keys"] if key != "output_layer._extra_state"]
        assert result["dict_keys"] == expected, name


def _load_without_extra_state():
    chunks, _ = helpers.build_chunks(1, 1)
    model = helpers.gpt_model(chunks[0])
    state = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    model.load_state_dict(state, strict=True)
    return sorted(k for k in model.state_dict() if k.endswith("_extra_state"))


def test_linear_layers_load_state_dicts_without_their_extra_state():
    extra_state_keys = run_distributed(1, _load_without_extra_state)[0]
    assert "decoder.layers.0.self_attention.linear_qkv._extra_state" in extra_state_keys
    assert "decoder.layers.3.mlp.linear_fc2._extra_state" in extra_state_keys


# ---- every layout's pieces tile the global tensors ------------------------------------------------------------

LAYOUTS = {  # name: (world size, tp, pp, vp, distributed optimizer)
    "tp2_pp2": (4, 2, 2, None, False),
    "tp2_pp2_vpp2_distopt": (4, 2, 2, 2, True),
    "tp2_dp2_distopt": (4, 2, 1, None, True),
    "pp4": (4, 1, 4, None, False),
    "tp4": (4, 4, 1, None, False),
}


def _layout_pieces(names):
    results = {}
    for name in names:
        _, tp, pp, vp, distributed_optimizer = LAYOUTS[name]
        chunks, optimizer = helpers.build_chunks(tp, pp, vp, distributed_optimizer=distributed_optimizer)
        helpers.train(chunks, optimizer, [0])  # creates Adam's state
        state_dict = helpers.checkpoint_state_dict(chunks, optimizer)
        model_part = {k: v for k, v in state_dict.items() if k != "optimizer"}
        optimizer_pieces = []
        for item in nested_values(state_dict["optimizer"]):
            if not isinstance(item, (ShardedTensor, ShardedTensorFactory)):
                continue
            for piece in nested_values(item.build()) if isinstance(item, ShardedTensorFactory) else [item]:
                flat = piece.flattened_range
                optimizer_pieces.append(
                    (
                        piece.key,
                        piece.global_shape,
                        piece.global_offset,
                        piece.local_shape,
                        (flat.start, flat.stop) if flat is not None else None,
                        is_main_replica(piece.replica_id),
                    )
                )
        results[name] = {
            "model": [piece for chunk in model_part.values() for piece in helpers.describe_pieces(chunk)],
            "optimizer": optimizer_pieces,
        }
    return results


@pytest.fixture(scope="module")
def layouts():
    by_rank = run_distributed(4, _layout_pieces, sorted(LAYOUTS))
    return {name: [piece for rank in by_rank for piece in rank[name]["model"]] for name in LAYOUTS}, {
        name: [piece for rank in by_rank for piece in rank[name]["optimizer"]] for name in LAYOUTS
    }


def _piece_index(global_offset, local_shape):
    prepended = len(global_offset) - len(local_shape)
    index = list(global_offset[:prepended])
    index += [slice(offset, offset + size) for offset, size in zip(global_offset[prepended:], local_shape)]
    return tuple(index)


def assert_main_replicas_tile(pieces):
    """Every global tensor / object grid is covered exactly once by main replicas, and other copies lie inside."""
    by_key = {}
    for piece in pieces:
        by_key.setdefault(piece[1], []).append(piece)
    for key, items in by_key.items():
        kind, _, global_shape = items[0][:3]
        count = torch.zeros(global_shape, dtype=torch.int32)
        for _, _, _, offset, local_shape, main in items:
            index = _piece_index(offset, local_shape) if kind == "tensor" else tuple(offset)
            if main:
                count[index] += 1
        coverage = sorted(set(count.flatten().tolist()))
        assert coverage == [1], f"{key}: main replicas cover elements {coverage} times"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_has_the_golden_keys_and_tiles_each_tensor_once(layouts, name):
    pieces = layouts[0][name]
    assert key_listing(pieces) == read_golden()[TIED_SECTION]
    assert_main_replicas_tile(pieces)


def test_a_last_stage_stores_its_tied_output_weight_as_a_copy_of_the_embedding(layouts):
    pieces = [p for p in layouts[0]["tp2_pp2"] if p[1] == "embedding.word_embeddings.weight"]
    # two TP pieces on the first stage (main) and the same two on the last stage (copies), none under output_layer
    assert sorted((p[3], p[5]) for p in pieces) == [((0, 0), False), ((0, 0), True), ((64, 0), False), ((64, 0), True)]
    assert not any(p[1].startswith("output_layer") for p in layouts[0]["tp2_pp2"])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_optimizer_state_is_keyed_and_sharded_like_its_parameters(layouts, name):
    model_shapes = {piece[1]: piece[2] for piece in layouts[0][name] if piece[0] == "tensor"}
    optimizer_pieces = layouts[1][name]
    keys = {piece[0] for piece in optimizer_pieces}
    expected = {f"optimizer.state.{state}.{key}" for key in model_shapes for state in ("exp_avg", "exp_avg_sq")}
    if LAYOUTS[name][4]:  # the distributed optimizer also stores its (here fp32) main parameters
        expected |= {f"optimizer.state.fp32_param.{key}" for key in model_shapes}
    assert keys == expected
    for key, global_shape, *_ in optimizer_pieces:
        assert global_shape == model_shapes[key.split(".", 3)[3]], key


@pytest.mark.parametrize("name", ["tp2_pp2_vpp2_distopt", "tp2_dp2_distopt"])
def test_distributed_optimizer_slices_cover_every_parameter_piece_once(layouts, name):
    slices = {}
    for key, _, global_offset, local_shape, flat, main in layouts[1][name]:
        assert flat is not None, f"{key}: expected a flat slice"
        if main:  # the other copies are TP-replicated tensors on TP rank > 0 and the last stage's tied weight
            slices.setdefault((key, global_offset, local_shape), []).append(flat)
    for (key, offset, local_shape), ranges in slices.items():
        covered = torch.zeros(math.prod(local_shape), dtype=torch.int32)
        for start, stop in ranges:
            covered[start:stop] += 1
        assert bool((covered == 1).all()), f"{key} at {offset}: flat slices do not cover the piece exactly once"
    split_between_ranks = any(len(ranges) > 1 for ranges in slices.values())
    assert split_between_ranks == (name == "tp2_dp2_distopt"), "only DP=2 splits parameter pieces between ranks"


# ---- the SwiGLU factory ---------------------------------------------------------------------------------------


def _fc1_piece(tp_rank, tp_size, rows=8, columns=3, layer=(0, 1, 4)):
    data = torch.arange(rows * columns, dtype=torch.float32).reshape(rows, columns)
    return ShardedTensor.from_rank_offsets(
        "fc1.weight", data, layer, (1, tp_rank, tp_size), replica_id=(0, 0, 0), prepend_axis_num=1
    )


def test_swiglu_factory_stores_gate_and_up_halves_as_pieces_of_the_global_tensor():
    factory = apply_swiglu_sharded_factory(_fc1_piece(tp_rank=1, tp_size=2), sharded_offsets=((0, 1, 4),))
    pieces = factory.build()
    gate, up = pieces["gate"], pieces["up"]
    assert (gate.global_shape, gate.global_offset) == ((4, 16, 3), (1, 4, 0))  # piece 1 of 4: gate rows of rank 1
    assert (up.global_shape, up.global_offset) == ((4, 16, 3), (1, 12, 0))  # piece 3 of 4: up rows of rank 1
    assert torch.equal(factory.merge_fn({"gate": gate.data, "up": up.data}), factory.data)


def test_swiglu_factory_splits_a_flat_slice_where_the_gate_half_ends():
    piece = _fc1_piece(tp_rank=0, tp_size=2)
    factory = apply_swiglu_sharded_factory(piece, sharded_offsets=((0, 1, 4),))
    flat = piece.data.flatten()[5:20]  # the gate half holds flat elements [0, 12)
    flat_factory = type(factory)(factory.key, flat, factory.build_fn, factory.merge_fn, (0, 0, 0), slice(5, 20))
    pieces = flat_factory.build()
    gate, up = pieces["gate"], pieces["up"]
    assert (gate.flattened_range, gate.global_offset) == (slice(5, 12), (1, 0, 0))
    assert (up.flattened_range, up.global_offset) == (slice(0, 8), (1, 8, 0))
    assert torch.equal(factory.merge_fn({"gate": gate.data, "up": up.data}), flat)
    only_up = type(factory)(factory.key, flat[7:], factory.build_fn, factory.merge_fn, (0, 0, 0), slice(12, 20))
    assert list(only_up.build()) == ["up"]


# ---- errors ---------------------------------------------------------------------------------------------------


def _model_errors():
    chunks, _ = helpers.build_chunks(1, 1)
    model = helpers.gpt_model(chunks[0])
    messages = []
    for call in (
        lambda: model.decoder.sharded_state_dict(sharded_offsets=((0, 0, 2),)),
        lambda: model.sharded_state_dict(sharded_offsets=((0, 0, 2),)),
    ):
        try:
            call()
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_block_and_model_reject_sharded_offsets():
    block_error, model_error = run_distributed(1, _model_errors)[0]
    assert "TransformerBlock.sharded_state_dict got sharded_offsets" in block_error
    assert "GPTModel.sharded_state_dict got sharded_offsets" in model_error


def _optimizer_errors():
    chunks, optimizer = helpers.build_chunks(1, 1, distributed_optimizer=True)
    helpers.train(chunks, optimizer, [0])
    state_dict = helpers.checkpoint_state_dict(chunks)
    messages = []
    for call in (
        lambda: optimizer.sharded_state_dict(state_dict, sharding_type="fully_sharded_bucket_space"),
        lambda: optimizer.sharded_state_dict({}),
    ):
        try:
            call()
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_distributed_optimizer_errors():
    sharding_type_error, missing_model_error = run_distributed(1, _optimizer_errors)[0]
    assert "sharding_type='fully_sharded_bucket_space' is not supported; use one of ('dp_reshardable'" in (
        sharding_type_error
    )
    assert "is not in the model's sharded state dict" in missing_model_error


def test_optimizer_state_must_have_its_parameters_shape():
    param = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"optimizer state 'optimizer.state.x.w' has shape \(3,\) but its parameter"):
        make_sharded_optimizer_tensor(param, torch.zeros(3), "optimizer.state.x")


def test_a_step_that_differs_between_parameters_is_rejected():
    state = {"state": {0: {"step": torch.tensor(3.0)}, 1: {"step": torch.tensor(4.0)}}}
    with pytest.raises(ValueError, match=r"step differs between parameters \(\[3.0, 4.0\]\)"):
        extract_common_step(state)
    assert extract_common_step({"state": {}}) is None


def test_extra_state_offsets_must_cover_the_leading_axes():
    with pytest.raises(ValueError, match=r"must cover the leading axes 0, 1, ... in turn, got axes \[1\]"):
        make_sharded_object_for_checkpoint(None, "k", sharded_offsets=((1, 0, 2),), replica_id=0)


def test_optimizer_state_of_a_parameter_missing_from_the_model_state_is_rejected():
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig, init_optimizer_state

    layer = torch.nn.Linear(2, 2)
    optimizer = FP32Optimizer(torch.optim.Adam(layer.parameters()), OptimizerConfig(lr=0.1), init_optimizer_state)
    with pytest.raises(ValueError, match="optimizer parameter 0 has state but no entry in the model's sharded state"):
        optimizer.sharded_state_dict({}, is_loading=True)
