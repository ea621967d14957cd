"""A HybridModel's distributed checkpoint has Megatron-Core 0.19's keys (one entry per layer, TE norm names, Mamba
in_proj / conv1d in pieces) and reshards: saved at TP=2, it loads at TP=1 and at PP=2 into models built from
another seed, which then hold exactly the saved weights."""

from megatron.core import dist_checkpointing
from tests.unit_tests.models.hybrid.hybrid_test_helpers import build_model, checkpoint_space
from tests.unit_tests.test_utilities import run_distributed

# (key, global shape) of the "M*-M-" test model's first three layers (hidden 64, d_inner 128, 4 groups of state 8,
# 8 Mamba heads, 8 attention heads of 8 with 4 key/value groups, ffn 128), the final norm and the embeddings.
MAMBA_LAYER = [
    ("mixer.A_log", (8,)),
    ("mixer.D", (8,)),
    ("mixer.dt_bias", (8,)),
    ("mixer.conv1d.bias.B", (32,)),
    ("mixer.conv1d.bias.C", (32,)),
    ("mixer.conv1d.bias.x", (128,)),
    ("mixer.conv1d.weight.B", (32, 1, 4)),
    ("mixer.conv1d.weight.C", (32, 1, 4)),
    ("mixer.conv1d.weight.x", (128, 1, 4)),
    ("mixer.in_proj._extra_state", None),
    ("mixer.in_proj.layer_norm_weight", (64,)),
    ("mixer.in_proj.weight.z", (128, 64)),
    ("mixer.in_proj.weight.x", (128, 64)),
    ("mixer.in_proj.weight.B", (32, 64)),
    ("mixer.in_proj.weight.C", (32, 64)),
    ("mixer.in_proj.weight.dt", (8, 64)),
    ("mixer.norm.weight", (128,)),
    ("mixer.out_proj._extra_state", None),
    ("mixer.out_proj.weight", (64, 128)),
]
ATTENTION_LAYER = [
    ("self_attention.linear_proj._extra_state", None),
    ("self_attention.linear_proj.weight", (64, 64)),
    ("self_attention.linear_qkv._extra_state", None),
    ("self_attention.linear_qkv.layer_norm_weight", (64,)),
    ("self_attention.linear_qkv.weight", (128, 64)),
]
MLP_LAYER = [
    ("mlp.linear_fc1._extra_state", None),
    ("mlp.linear_fc1.layer_norm_weight", (64,)),
    ("mlp.linear_fc1.weight", (128, 64)),
    ("mlp.linear_fc2._extra_state", None),
    ("mlp.linear_fc2.weight", (64, 128)),
]
MODEL = [
    ("decoder.final_norm.weight", (64,)),
    ("embedding.word_embeddings.weight", (64, 64)),
    ("output_layer.weight", (64, 64)),
]


def _keys_and_shapes():
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = build_model().sharded_state_dict()
    apply_factories(sharded)
    return {
        item.key: tuple(item.global_shape) if isinstance(item, ShardedTensor) else None
        for item in nested_values(sharded)
    }


def test_checkpoint_keys_are_megatron_cores():
    expected = dict(MODEL)
    for index, layer in ((0, MAMBA_LAYER), (1, ATTENTION_LAYER), (2, MLP_LAYER), (3, MAMBA_LAYER), (4, MLP_LAYER)):
        expected.update({f"decoder.layers.{index}.{key}": shape for key, shape in layer})
    assert run_distributed(1, _keys_and_shapes)[0] == expected


def _save_at_tp2(directory: str):
    model = build_model(tp=2, seed=1)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, directory)
    return checkpoint_space(model)


def _load(directory: str, tp: int, pp: int, pattern: str):
    model = build_model(tp=tp, pp=pp, pattern=pattern, seed=2)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(loaded["model"])
    return checkpoint_space(model)


def test_checkpoint_saved_at_tp2_loads_at_tp1_and_pp2(tmp_path):
    directory = tmp_path / "tp2"
    directory.mkdir()
    directory = str(directory)
    saved = run_distributed(2, _save_at_tp2, directory)[0]
    fresh = run_distributed(1, checkpoint_space_of_a_fresh_model)[0]
    assert any(not fresh[key].equal(saved[key]) for key in saved)  # the loads below have something to do
    at_tp1 = run_distributed(1, _load, directory, 1, 1, "M*-M-")[0]
    assert at_tp1.keys() == saved.keys() and all(at_tp1[key].equal(saved[key]) for key in saved)
    for rank, at_pp2 in enumerate(run_distributed(2, _load, directory, 1, 2, "M*-|M-")):
        assert at_pp2.keys() == saved.keys() and all(at_pp2[key].equal(saved[key]) for key in saved), rank


def checkpoint_space_of_a_fresh_model():
    return checkpoint_space(build_model(seed=2))
