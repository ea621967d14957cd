"""A GPT checkpoint saved at one parallel layout loads at another with identical model and optimizer state.

The model (SwiGLU with biases, RMSNorm, grouped-query attention, rotary positions, tied embeddings: every special case
of the key layout) is trained one Adam step at TP2 x PP2 with the distributed optimizer and saved; it then loads at
TP1, TP4, PP4 and TP2 x DP2 into models built from another seed, with the plain or the distributed optimizer. Each of
those saves what it loaded and the TP2 x PP2 x VPP2 layout loads it back (the reverse directions). Everywhere:

- every parameter equals the saved one exactly (gathered to whole tensors, compared by global name);
- re-saved checkpoints hold exactly the same tensors, optimizer states included (keys the saving optimizer has);
- the next two training steps give the losses of continuing without a save: the first depends on the weights, the
  second on the Adam moments and step counter as well.

A bf16 model with fp32 main parameters moves between the distributed and the mixed-precision optimizer the same way.
"""

import pytest
import torch

from megatron.core import dist_checkpointing
from tests.unit_tests.dist_checkpointing import gpt_checkpoint_helpers as helpers
from tests.unit_tests.test_utilities import run_distributed

SAVE_LAYOUT = dict(tp=2, pp=2, distributed_optimizer=True)
# name: (tp, pp, vp, distributed optimizer) at 4 ranks (the rest is data parallel)
OTHER_LAYOUTS_4 = {"tp4": (4, 1, None, False), "pp4": (1, 4, None, True), "tp2_dp2": (2, 1, None, True)}
REVERSE_LAYOUT = dict(tp=2, pp=2, vp=2)  # loads everything back; alternates the optimizer kind
CONTINUED_STEPS = [1, 2]
LOSS_TOLERANCE = 1e-5  # fp32 rounding differs between layouts; the first loss after a load is bitwise the weights'


def _weights_and_state(chunks, optimizer, directory):
    """Load ``directory`` into the chunks and optimizer; return the full weights and whether the tied copy agrees."""
    request = helpers.checkpoint_state_dict(chunks, optimizer, is_loading=True)
    helpers.load_into(chunks, optimizer, dist_checkpointing.load(request, directory))
    return helpers.full_weights(chunks), helpers.tied_copy_matches_embedding(chunks)


def _save(chunks, optimizer, directory) -> None:
    dist_checkpointing.save(helpers.checkpoint_state_dict(chunks, optimizer), directory)


def _save_at_tp2_pp2_then_load_at_other_4_rank_layouts(root):
    chunks, optimizer = helpers.build_chunks(**SAVE_LAYOUT, seed=1)
    helpers.train(chunks, optimizer, [0])
    _save(chunks, optimizer, root / "tp2_pp2")
    results = {"saved": helpers.full_weights(chunks), "continued": helpers.train(chunks, optimizer, CONTINUED_STEPS)}
    for name, (tp, pp, vp, distributed_optimizer) in OTHER_LAYOUTS_4.items():
        chunks, optimizer = helpers.build_chunks(tp, pp, vp, seed=2, distributed_optimizer=distributed_optimizer)
        weights, tied = _weights_and_state(chunks, optimizer, root / "tp2_pp2")
        _save(chunks, optimizer, root / name)
        results[name] = {"weights": weights, "tied": tied, "losses": helpers.train(chunks, optimizer, CONTINUED_STEPS)}
    return results


def _load_at_tp1(root):
    chunks, optimizer = helpers.build_chunks(1, 1, seed=3)
    weights, tied = _weights_and_state(chunks, optimizer, root / "tp2_pp2")
    _save(chunks, optimizer, root / "tp1")
    return {"weights": weights, "tied": tied, "losses": helpers.train(chunks, optimizer, CONTINUED_STEPS)}


def _load_back_at_tp2_pp2_vpp2(root, names):
    results = {}
    for index, name in enumerate(names):
        distributed_optimizer = index % 2 == 0
        chunks, optimizer = helpers.build_chunks(**REVERSE_LAYOUT, seed=4, distributed_optimizer=distributed_optimizer)
        weights, tied = _weights_and_state(chunks, optimizer, root / name)
        results[name] = {"weights": weights, "tied": tied, "losses": helpers.train(chunks, optimizer, CONTINUED_STEPS)}
    return results


def _bf16_save_at_tp2_dp2(root):
    chunks, optimizer = helpers.build_chunks(2, 1, seed=1, distributed_optimizer=True, bf16=True)
    helpers.train(chunks, optimizer, [0])
    _save(chunks, optimizer, root / "bf16_tp2_dp2")
    return helpers.full_weights(chunks)


def _bf16_load_at_tp1(root):
    chunks, optimizer = helpers.build_chunks(1, 1, seed=3, bf16=True)
    weights, _ = _weights_and_state(chunks, optimizer, root / "bf16_tp2_dp2")
    _save(chunks, optimizer, root / "bf16_tp1")
    return type(optimizer).__name__, weights


def _merge_ranks(per_rank, name=None):
    """Whole weights from every rank (each rank reports its stages), the tied flags and the last stage's losses."""
    weights, tied, losses = {}, [], None
    for result in per_rank:
        result = result if name is None else result[name]
        weights.update(result["weights"])
        tied.append(result["tied"])
        if result["losses"][0] is not None:
            assert losses is None or losses == result["losses"], "data-parallel ranks report different losses"
            losses = result["losses"]
    return {"weights": weights, "tied": all(tied), "losses": losses}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resharding")
    for name in ["tp2_pp2", "tp1", *OTHER_LAYOUTS_4, "bf16_tp2_dp2", "bf16_tp1"]:
        (root / name).mkdir()
    first = run_distributed(4, _save_at_tp2_pp2_then_load_at_other_4_rank_layouts, root)
    saved = {}
    for rank in first:
        saved.update(rank["saved"])
    continued = next(rank["continued"] for rank in first if rank["continued"][0] is not None)
    loaded = {name: _merge_ranks(first, name) for name in OTHER_LAYOUTS_4}
    loaded["tp1"] = _merge_ranks(run_distributed(1, _load_at_tp1, root))
    back_names = ["tp1", *OTHER_LAYOUTS_4]
    back = run_distributed(4, _load_back_at_tp2_pp2_vpp2, root, back_names)
    loaded_back = {name: _merge_ranks(back, name) for name in back_names}
    bf16_saved = {}
    for rank in run_distributed(4, _bf16_save_at_tp2_dp2, root):
        bf16_saved.update(rank)
    bf16_optimizer, bf16_loaded = run_distributed(1, _bf16_load_at_tp1, root)[0]
    return {
        "root": root,
        "saved": saved,
        "continued": continued,
        "loaded": loaded,
        "loaded_back": loaded_back,
        "bf16": {"saved": bf16_saved, "loaded": bf16_loaded, "optimizer": bf16_optimizer},
    }


LOADED = ["tp1", *OTHER_LAYOUTS_4]


def _assert_same_weights(actual, expected, what):
    assert actual.keys() == expected.keys(), f"{what}: parameters {set(actual) ^ set(expected)} differ"
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{what}: {name} differs"


@pytest.mark.parametrize("name", LOADED)
def test_weights_saved_at_tp2_pp2_load_exactly(runs, name):
    _assert_same_weights(runs["loaded"][name]["weights"], runs["saved"], f"TP2xPP2 -> {name}")
    assert runs["loaded"][name]["tied"]


@pytest.mark.parametrize("name", LOADED)
def test_weights_saved_at_other_layouts_load_back_at_tp2_pp2_vpp2(runs, name):
    _assert_same_weights(runs["loaded_back"][name]["weights"], runs["saved"], f"{name} -> TP2xPP2xVPP2")
    assert runs["loaded_back"][name]["tied"]


@pytest.mark.parametrize("name", LOADED)
def test_training_after_a_load_continues_as_without_a_save(runs, name):
    for direction in ("loaded", "loaded_back"):
        losses = runs[direction][name]["losses"]
        for step, (got, want) in enumerate(zip(losses, runs["continued"])):
            assert abs(got - want) <= LOSS_TOLERANCE * abs(want), f"{direction} {name} step {step}: {got} vs {want}"


@pytest.mark.parametrize("name", LOADED)
def test_resaved_checkpoints_hold_the_same_model_and_optimizer_tensors(runs, name):
    original = dist_checkpointing.load_plain_tensors(runs["root"] / "tp2_pp2")
    resaved = dist_checkpointing.load_plain_tensors(runs["root"] / name)
    # The distributed optimizer also stores the (here fp32) main parameters; a plain fp32 optimizer has none.
    common = original.keys() & resaved.keys()
    only_one = original.keys() ^ resaved.keys()
    assert {key for key in only_one if not key.startswith("optimizer.state.fp32_param.")} == set()
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in common)
    for key in sorted(common):
        assert torch.equal(original[key], resaved[key]), f"{key} differs after loading at {name} and saving again"


def test_bf16_model_and_fp32_main_params_move_from_the_distributed_to_the_mixed_precision_optimizer(runs):
    bf16 = runs["bf16"]
    assert bf16["optimizer"] == "Float16OptimizerWithFloat16Params"
    _assert_same_weights(bf16["loaded"], bf16["saved"], "bf16 TP2xDP2 (distributed) -> TP1 (mixed precision)")
    original = dist_checkpointing.load_plain_tensors(runs["root"] / "bf16_tp2_dp2")
    resaved = dist_checkpointing.load_plain_tensors(runs["root"] / "bf16_tp1")
    assert original.keys() == resaved.keys()
    fp32_keys = [key for key in original if key.startswith("optimizer.state.fp32_param.")]
    assert fp32_keys and all(original[key].dtype == torch.float32 for key in fp32_keys)
    for key in original:
        assert torch.equal(original[key], resaved[key]), f"{key} differs after the move"


def _chained_optimizer(chunks):
    """Two FP32 optimizers, one for the transformer layers and one for everything else, chained."""
    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, OptimizerConfig, init_optimizer_state

    config = OptimizerConfig(lr=1e-2)
    named = list(chunks[0].named_parameters())
    parts = [[p for n, p in named if ".layers." in n], [p for n, p in named if ".layers." not in n]]
    return ChainedOptimizer(
        [FP32Optimizer(torch.optim.Adam(params, lr=1e-2), config, init_optimizer_state) for params in parts]
    )


def _chained_round_trip(root):
    chunks, _ = helpers.build_chunks(1, 1, seed=1)
    optimizer = _chained_optimizer(chunks)
    helpers.train(chunks, optimizer, [0])
    _save(chunks, optimizer, root)
    saved = [{k: v.clone() for k, v in state.items()} for state in optimizer.chained_optimizers[0].state.values()]
    chunks, _ = helpers.build_chunks(1, 1, seed=2)
    optimizer = _chained_optimizer(chunks)
    _weights_and_state(chunks, optimizer, root)
    loaded = list(optimizer.chained_optimizers[0].state.values())
    same = len(saved) == len(loaded) and all(
        torch.equal(a[name], b[name]) for a, b in zip(saved, loaded) for name in ("exp_avg", "exp_avg_sq", "step")
    )
    return same, sorted(dist_checkpointing.load_tensors_metadata(root))


def test_chained_optimizers_store_their_states_under_their_index(tmp_path):
    same_state, keys = run_distributed(1, _chained_round_trip, tmp_path)[0]
    assert same_state
    assert "chained_0.optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" in keys
    assert "chained_1.optimizer.state.exp_avg_sq.embedding.word_embeddings.weight" in keys
