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
