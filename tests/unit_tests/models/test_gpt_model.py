"""GPTModel at TP=2 and TP=4, with and without sequence parallelism, computes what TP=1 computes."""

import pytest
import torch

from tests.unit_tests.models.gpt_test_helpers import (
    VARIANTS,
    assert_close_dicts,
    batch,
    build_model,
    full_gradients,
    full_weights,
    gather_logits,
    relative_error,
)
from tests.unit_tests.test_utilities import run_distributed


def _run(tp: int, sp: bool, variant: str):
    model = build_model(tp, sp, variant)
    tokens, position_ids, labels = batch()
    logits = model(tokens, position_ids, attention_mask=None)
    loss = model(tokens, position_ids, attention_mask=None, labels=labels)
    loss.mean().backward()
    return {
        "loss": loss.detach(),
        "logits": gather_logits(logits.detach()),
        "grads": full_gradients(model),
        "weights": full_weights(model),
    }


@pytest.fixture(scope="module")
def reference():
    return {variant: run_distributed(1, _run, 1, False, variant)[0] for variant in VARIANTS}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_tensor_parallel_matches_single_process(reference, variant, tp, sp):
    expected = reference[variant]
    results = run_distributed(tp, _run, tp, sp, variant)
    for rank, result in enumerate(results):
        assert_close_dicts(result["weights"], expected["weights"], 0.0, f"rank {rank} weights")
        assert relative_error(result["loss"], expected["loss"]) <= 1e-5
        assert relative_error(result["logits"], expected["logits"]) <= 1e-5
        assert_close_dicts(result["grads"], expected["grads"], 1e-5, f"rank {rank} grads")


def test_parameter_names_follow_megatron(reference):
    names = set(reference["gpt2"]["weights"])
    for expected in (
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_qkv.bias",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc2.bias",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ):
        assert expected in names
    llama = set(reference["llama"]["weights"])
    assert "output_layer.weight" not in llama  # tied to the word embedding
    assert "decoder.layers.0.mlp.linear_fc1.bias" not in llama
    qk = set(reference["qk_norm"]["weights"])
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in qk
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in qk
    assert "decoder.layers.0.self_attention.linear_proj.bias" not in qk


def test_loss_is_cross_entropy_of_logits(reference):
    result = reference["gpt2"]
    _, _, labels = batch()
    expected = torch.nn.functional.cross_entropy(
        result["logits"].reshape(-1, result["logits"].shape[-1]), labels.reshape(-1), reduction="none"
    ).view_as(labels)
    assert relative_error(result["loss"], expected) <= 1e-6


def _stage_weights(tp: int, pp: int, vpp, variant: str):
    """Build this rank's pipeline chunks straight from the seed and name their weights by global layer number."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from tests.unit_tests.models.gpt_test_helpers import SEQ, VOCAB, build_config, gather_tensor_parallel

    parallel_state.initialize_model_parallel(tp, pp, vpp)
    model_parallel_cuda_manual_seed(1234)
    spec = VARIANTS[variant]
    overrides = {
        **spec["config"],
        "num_layers": 4,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
        "pipeline_dtype": torch.float32,
    }
    config = build_config(tp, False, overrides)
    weights = {}
    for vp_stage in range(vpp or 1):
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage if vpp else None,
            **spec["model"],
        )
        for name, param in model.named_parameters():
            if name.startswith("decoder.layers."):
                local = int(name.split(".")[2])
                global_number = model.decoder.layers[local].layer_number - 1
                name = name.replace(f"decoder.layers.{local}.", f"decoder.layers.{global_number}.", 1)
            weights[name] = gather_tensor_parallel(param.detach(), param)
    return weights


def _full_weights_four_layers(variant: str):
    from tests.unit_tests.models.gpt_test_helpers import build_model

    return full_weights(build_model(1, False, variant, config_overrides={"num_layers": 4}))


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("tp,pp,vpp", [(1, 2, None), (2, 2, None), (1, 2, 2), (1, 4, None)])
def test_every_layout_builds_the_same_weights_from_the_seed(variant, tp, pp, vpp):
    """use_cpu_initialization: each pipeline stage draws its layers' weights from per-layer streams, so the
    assembled model does not depend on the TP/PP/VPP layout (no weight copying needed)."""
    expected = run_distributed(1, _full_weights_four_layers, variant)[0]
    gathered = {}
    for rank_weights in run_distributed(tp * pp, _stage_weights, tp, pp, vpp, variant):
        gathered.update(rank_weights)
    if VARIANTS[variant]["model"].get("share_embeddings_and_output_weights"):
        # The last stage's copy of a tied output weight equals the word embedding (all-reduced at construction).
        torch.testing.assert_close(gathered.pop("output_layer.weight"), expected["embedding.word_embeddings.weight"])
    assert_close_dicts(gathered, expected, 0.0, f"tp={tp} pp={pp} vpp={vpp}")
