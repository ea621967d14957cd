"""HybridModel ("M*-M-": Mamba-2, grouped-query attention, squared-ReLU MLP) at TP=2/4 with and without sequence
parallelism, and at PP=2 split by '|', computes what the single-process model computes: loss, logits and every
gradient, compared in checkpoint space (see hybrid_test_helpers)."""

import pytest

from tests.unit_tests.models.hybrid.hybrid_test_helpers import (
    PATTERN,
    SEQ,
    assert_close_dicts,
    batch,
    build_model,
    checkpoint_space,
    gather_logits,
    relative_error,
    run_pipeline,
)
from tests.unit_tests.test_utilities import run_distributed


def _run(tp: int, sp: bool):
    model = build_model(tp, sp)
    tokens, position_ids, labels = batch()
    logits = model(tokens, position_ids, attention_mask=None)
    loss = model(tokens, position_ids, attention_mask=None, labels=labels)
    loss.mean().backward()
    return {
        "loss": loss.detach(),
        "logits": gather_logits(logits.detach()),
        "weights": checkpoint_space(model),
        "grads": checkpoint_space(model, gradients=True),
        "layer_numbers": [layer.layer_number for layer in model.decoder.layers],
    }


@pytest.fixture(scope="module")
def reference():
    return run_distributed(1, _run, 1, False)[0]


def test_single_process_model_is_the_pattern(reference):
    assert reference["layer_numbers"] == [1, 2, 3, 4, 5]
    keys = set(reference["weights"])
    assert "decoder.layers.0.mixer.in_proj.weight.z" in keys
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.2.mlp.linear_fc1.layer_norm_weight" in keys
    assert "decoder.final_norm.weight" in keys
    # every layer, and every parameter of it, takes part in the loss
    assert all(grad.abs().sum() > 0 for grad in reference["grads"].values())


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_tensor_parallel_matches_single_process(reference, tp, sp):
    for rank, result in enumerate(run_distributed(tp, _run, tp, sp)):
        assert_close_dicts(result["weights"], reference["weights"], 0.0, f"tp={tp} rank {rank} weights")
        assert relative_error(result["loss"], reference["loss"]) <= 1e-5
        assert relative_error(result["logits"], reference["logits"]) <= 1e-5
        assert_close_dicts(result["grads"], reference["grads"], 1e-5, f"tp={tp} sp={sp} rank {rank} grads")


def test_pipeline_split_by_pipes_matches_single_stage():
    expected = run_distributed(1, run_pipeline, 1, PATTERN)[0]
    first, last = run_distributed(2, run_pipeline, 2, "M*-|M-")
    assert (first["layers"], first["numbers"], last["layers"], last["numbers"]) == ("M*-", [1, 2, 3], "M-", [4, 5])
    assert first["loss"] is None and relative_error(last["loss"], expected["loss"]) <= 1e-6
    for result in (first, last):
        assert_close_dicts(result["weights"], expected["weights"], 0.0, "pp=2 weights")
        assert_close_dicts(result["grads"], expected["grads"], 1e-5, "pp=2 grads")


def test_virtual_pipeline_stages_from_pipes_match_single_stage():
    """Four '|' segments on PP=2 are two virtual stages per rank (segment vp_stage * pp + pp_rank), run by the
    interleaved schedule."""
    expected = run_distributed(1, run_pipeline, 1, "M*-M-M-")[0]
    first, last = run_distributed(2, run_pipeline, 2, "M*|-M|-M|-", 2)
    assert (first["layers"], first["numbers"]) == ("M*|-M", [1, 2, 5, 6])
    assert (last["layers"], last["numbers"]) == ("-M|-", [3, 4, 7])
    assert first["loss"] is None and relative_error(last["loss"], expected["loss"]) <= 1e-6
    merged_weights, merged_grads = {**first["weights"], **last["weights"]}, {**first["grads"], **last["grads"]}
    assert_close_dicts(merged_weights, expected["weights"], 0.0, "pp=2 vp=2 weights")
    assert_close_dicts(merged_grads, expected["grads"], 1e-5, "pp=2 vp=2 grads")


def _build_error(pattern: str, config_overrides: dict):
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from tests.unit_tests.models.hybrid.hybrid_test_helpers import build_config

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    config = build_config(**{"num_layers": 5, **config_overrides})
    try:
        HybridModel(config, hybrid_stack_spec, vocab_size=64, max_sequence_length=SEQ, hybrid_layer_pattern=pattern)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "pattern, overrides, message",
    [
        ("M*-M", {}, "config.num_layers (5) must equal the number of layers in the hybrid layer pattern 'M*-M' (4)"),
        ("M*|-M-", {}, "has 2 '|'-separated segments but the model has 1 pipeline model chunks"),
        ("M*EM-", {}, "layer_type_list 'M*EM-' has MoE layers ('E') but config.num_moe_experts is None"),
        ("M*GM-", {}, "not supported yet: Gated DeltaNet layers ('G')"),
        (
            "M*-M-",
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
            "not supported yet: recompute_granularity='full' for hybrid models",
        ),
        (
            "M*-M-",
            {"cpu_offloading": True, "cpu_offloading_num_layers": 1},
            "not supported yet: activation offloading in hybrid (Mamba) models",
        ),
        (
            "M*-M-",
            {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]},
            "not supported yet: activation offloading in hybrid (Mamba) models",
        ),
        (
            "M*-M-",
            {"pipeline_model_parallel_layout": "Et*5L"},
            "a hybrid model's pipeline stages come from '|' in its layer pattern (--hybrid-layer-pattern)",
        ),
    ],
)
def test_bad_settings_are_refused_before_building(pattern, overrides, message):
    error = run_distributed(1, _build_error, pattern, overrides)[0]
    assert error is not None and message in error, error
