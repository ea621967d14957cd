"""Zero-centred gamma (``--apply-layernorm-1p``): the stored weight is gamma - 1, in the standalone norms and in the
norm fused into the Transformer Engine layout's first linear, on both layer specs."""

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.torch_norm import LayerNorm, RMSNorm
from tests.unit_tests.models.gpt_test_helpers import SEQ, VOCAB, batch, build_config
from tests.unit_tests.test_utilities import Utils, run_distributed


@pytest.mark.parametrize("norm_class", [LayerNorm, RMSNorm])
def test_a_zero_centred_norm_is_the_plain_norm_with_gamma_plus_one(norm_class):
    torch.manual_seed(0)
    centred = norm_class(16, eps=1e-5, zero_centered_gamma=True)
    assert torch.equal(centred.weight, torch.zeros(16))  # gamma starts at one
    plain = norm_class(16, eps=1e-5)
    with torch.no_grad():
        centred.weight.normal_()
        plain.weight.copy_(centred.weight + 1)
        if norm_class is LayerNorm:
            centred.bias.normal_()
            plain.bias.copy_(centred.bias)
    x = torch.randn(4, 16, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    centred(x).pow(2).sum().backward()
    plain(x_plain).pow(2).sum().backward()
    torch.testing.assert_close(centred(x), plain(x_plain))
    torch.testing.assert_close(x.grad, x_plain.grad)
    torch.testing.assert_close(centred.weight.grad, plain.weight.grad)


def _norm_weights(model: torch.nn.Module):
    """Every norm's gamma: standalone norms' ``weight`` and the fused ``layer_norm_weight``."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            yield f"{name}.weight", module.weight
        elif getattr(module, "layer_norm_weight", None) is not None:
            yield f"{name}.layer_norm_weight", module.layer_norm_weight


def _logits_with_and_without_zero_centred_gamma(spec_name: str):
    Utils.initialize_model_parallel(1)
    spec = {"local": get_gpt_layer_local_spec, "transformer_engine": get_gpt_layer_with_transformer_engine_spec}
    models = []
    for centred in (True, False):
        model_parallel_cuda_manual_seed(3)
        config = build_config(1, False, {"layernorm_zero_centered_gamma": centred, "qk_layernorm": True})
        models.append(GPTModel(config, spec[spec_name](qk_layernorm=True), vocab_size=VOCAB, max_sequence_length=SEQ))
    centred, plain = models
    plain.load_state_dict(centred.state_dict())
    gammas = dict(_norm_weights(centred))
    assert len(gammas) == 2 * 4 + 1  # per layer: 2 pre-norms, q and k norms; the final norm
    assert all(torch.equal(gamma, torch.zeros_like(gamma)) for gamma in gammas.values())
    with torch.no_grad():
        for (name, gamma), (_, plain_gamma) in zip(gammas.items(), _norm_weights(plain)):
            gamma.uniform_(-0.5, 0.5)
            plain_gamma.copy_(gamma + 1)
    tokens, positions, _ = batch()
    return [model(tokens, positions, None).detach() for model in models]


@pytest.mark.parametrize("spec_name", ["local", "transformer_engine"])
def test_a_gpt_model_with_zero_centred_gamma_equals_one_with_gamma_plus_one(spec_name):
    centred, plain = run_distributed(1, _logits_with_and_without_zero_centred_gamma, spec_name)[0]
    torch.testing.assert_close(centred, plain)
