"""GPTModel split over pipeline stages (1F1B, interleaved, with TP/SP, uneven) computes what one stage computes.

For each layout every rank builds its stages with the single-stage model's weights, runs one step of several
micro-batches through the schedule (with finalize_model_grads), and reports its losses and gradients under the
single-stage parameter names; together the ranks must reproduce the single-stage run (fp32, relative error <= 1e-5).
Layouts sharing a world size run in one multi-rank job to keep start-up cheap.
"""

import pytest
import torch

from megatron.core import parallel_state
from tests.unit_tests.models.gpt_test_helpers import relative_error
from tests.unit_tests.pipeline_parallel import gpt_pipeline_helpers as gpt
from tests.unit_tests.test_utilities import Utils, run_distributed

# name: (world size, tp, sp, pp, vp, variant, num_layers, num_microbatches, layout overrides)
LAYOUTS = {
    "pp2_tied_rope": (2, 1, False, 2, None, "llama", 4, 4, {}),
    "pp2_vpp2": (2, 1, False, 2, 2, "gpt2", 4, 4, {}),
    "pp2_uneven_first": (2, 1, False, 2, None, "gpt2", 4, 3, {"num_layers_in_first_pipeline_stage": 1}),
    "pp4": (4, 1, False, 4, None, "gpt2", 4, 5, {}),
    "pp4_vpp2_tied": (4, 1, False, 4, 2, "llama", 8, 4, {}),
    "tp2_pp2": (4, 2, False, 2, None, "gpt2", 4, 3, {}),
    "tp2_pp2_sp": (4, 2, True, 2, None, "llama", 4, 3, {}),
    "pp4_uneven_first_last": (
        4,
        1,
        False,
        4,
        None,
        "qk_norm",
        6,
        4,
        {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 1},
    ),
}
OPTIMIZER_STEPS = 2


def _reference(cases):
    """Single-stage losses and gradients for each (variant, num_layers, num_microbatches)."""
    results = {}
    for variant, num_layers, num_microbatches in cases:
        Utils.initialize_model_parallel(1, 1)
        model = gpt.build_full_model(1, False, variant, num_layers)
        model.config.finalize_model_grads_func = gpt.finalize_model_grads
        losses = gpt.run_schedule([model], gpt.microbatches(num_microbatches), num_microbatches)
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        results[(variant, num_layers, num_microbatches)] = {"losses": losses, "grads": grads}
    return results


def _run_layouts(names):
    results = {}
    for name in names:
        _, tp, sp, pp, vp, variant, num_layers, num_microbatches, layout = LAYOUTS[name]
        Utils.initialize_model_parallel(tp, pp, vp)
        full = gpt.build_full_model(tp, sp, variant, num_layers)
        chunks, _ = gpt.build_stage_chunks(tp, sp, variant, num_layers, pp, vp, **layout)
        result = {
            "tied_at_init": gpt.tied_weights_match(chunks),
            "layer_numbers": [[layer.layer_number for layer in c.decoder.layers] for c in chunks],
            "layer_keys": [
                sorted({k.split(".")[2] for k in c.state_dict() if k.startswith("decoder.layers.")}) for c in chunks
            ],
        }
        gpt.copy_weights(full, chunks)
        batches = gpt.microbatches(num_microbatches)
        result["losses"] = gpt.run_schedule(chunks, batches, num_microbatches)
        result["grads"] = gpt.stage_gradients(chunks)
        result["forward_only_losses"] = gpt.run_schedule(chunks, batches, num_microbatches, forward_only=True)
        params = [p for c in chunks for p in c.parameters()]
        optimizer = torch.optim.SGD(params, lr=0.5)
        for _ in range(OPTIMIZER_STEPS):
            optimizer.step()
            optimizer.zero_grad()
            gpt.run_schedule(chunks, batches, num_microbatches)
        result["tied_after_steps"] = gpt.tied_weights_match(chunks)
        result["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
        results[name] = result
    return results


@pytest.fixture(scope="module")
def runs():
    by_world = {}
    for name, spec in LAYOUTS.items():
        by_world.setdefault(spec[0], []).append(name)
    per_layout = {}
    for world_size, names in by_world.items():
        for rank, rank_results in enumerate(run_distributed(world_size, _run_layouts, names, timeout=300)):
            for name, result in rank_results.items():
                per_layout.setdefault(name, []).append(result)
    cases = sorted({(spec[5], spec[6], spec[7]) for spec in LAYOUTS.values()})
    return per_layout, run_distributed(1, _reference, cases, timeout=300)[0]


def _expected(references, name):
    spec = LAYOUTS[name]
    return references[(spec[5], spec[6], spec[7])]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_loss_and_every_gradient_match_a_single_stage(runs, name):
    per_layout, references = runs
    expected = _expected(references, name)
    ranks = per_layout[name]
    last = [r for r in ranks if r["pp_rank"] == LAYOUTS[name][3] - 1]
    for result in last:
        assert len(result["losses"]) == len(expected["losses"])
        for got, want in zip(result["losses"], expected["losses"]):
            assert relative_error(got["lm loss"], want["lm loss"]) <= 1e-5
    for result in ranks:
        if result["pp_rank"] != LAYOUTS[name][3] - 1:
            assert result["losses"] == []
    seen = set()
    for rank, result in enumerate(ranks):
        for param_name, grad in result["grads"].items():
            error = relative_error(grad, expected["grads"][param_name])
            assert error <= 1e-5, f"rank {rank} {param_name}: relative error {error:.2e}"
            seen.add(param_name)
    assert seen == set(expected["grads"]), f"parameters no stage reported: {set(expected['grads']) - seen}"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_forward_only_returns_the_same_losses(runs, name):
    for result in runs[0][name]:
        assert len(result["forward_only_losses"]) == len(result["losses"])
        for got, want in zip(result["forward_only_losses"], result["losses"]):
            assert torch.equal(got["lm loss"], want["lm loss"])


@pytest.mark.parametrize("name", ["pp2_tied_rope", "pp4_vpp2_tied", "tp2_pp2_sp"])
def test_tied_embeddings_start_equal_and_stay_equal_after_optimizer_steps(runs, name):
    for result in runs[0][name]:
        assert result["tied_at_init"]
        assert result["tied_after_steps"]


def test_stage_layers_carry_global_numbers_but_local_state_dict_keys(runs):
    # pp4 with 1 + 2 + 2 + 1 layers; pp4_vpp2: 8 layers, chunk c of rank r holds layer c * 4 + r (one per chunk).
    uneven = [r["layer_numbers"] for r in runs[0]["pp4_uneven_first_last"]]
    assert uneven == [[[1]], [[2, 3]], [[4, 5]], [[6]]]
    interleaved = [r["layer_numbers"] for r in runs[0]["pp4_vpp2_tied"]]
    assert interleaved == [[[1], [5]], [[2], [6]], [[3], [7]], [[4], [8]]]
    assert [r["layer_keys"] for r in runs[0]["pp4_uneven_first_last"]] == [[["0"]], [["0", "1"]], [["0", "1"]], [["0"]]]
