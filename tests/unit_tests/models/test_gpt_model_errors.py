"""Every error the model-building code raises, with its message."""

import re

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_inference_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from tests.unit_tests.models.gpt_test_helpers import VOCAB, build_config
from tests.unit_tests.test_utilities import run_distributed


def _capture(call):
    try:
        call()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _model_errors():
    parallel_state.initialize_model_parallel(2)
    config = build_config(2, False, {})
    spec = get_gpt_layer_local_spec()
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=8, pre_process=False)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    return [
        _capture(lambda: GPTModel(config, spec, vocab_size=VOCAB + 1, max_sequence_length=8)),
        _capture(lambda: GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=8, mtp_block_spec=spec)),
        _capture(lambda: model.set_input_tensor([torch.zeros(1), torch.zeros(1)])),
        _capture(lambda: model(tokens, None, None)),
        _capture(lambda: LanguageModelEmbedding(config, VOCAB, 8, position_embedding_type="alibi")),
        _capture(lambda: LanguageModelEmbedding(config, VOCAB, 8)(tokens, None)),
        _capture(lambda: LanguageModelEmbedding(config, VOCAB, 8)(tokens, tokens, tokentype_ids=tokens)),
        _capture(lambda: TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[spec] * 3))),
        _capture(lambda: TransformerBlock(config, "not a spec")),
        _capture(
            lambda: GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=8, position_embedding_type="yarn")
        ),
        _capture(lambda: model(tokens, None, None, output_processor=print)),
        _capture(lambda: WrappedTorchNorm(config, 8, normalization="BatchNorm")),
    ]


def test_model_errors():
    messages = run_distributed(2, _model_errors)[0]
    expected = [
        r"ValueError: vocab_size \(129\) must be divisible by the tensor-parallel size \(2\)",
        r"ValueError: not supported yet: multi-token prediction \(mtp_block_spec\)",
        r"ValueError: GPTModel takes one input tensor per stage, got 2",
        r"ValueError: TransformerBlock got no hidden_states: a stage without pre_process needs set_input_tensor",
        r"ValueError: position_embedding_type='alibi' is not valid",
        r"ValueError: position_ids are required with learned_absolute position embeddings",
        r"ValueError: tokentype_ids given but the embedding was built with num_tokentypes=0",
        r"ValueError: the block spec lists 3 layers but this stage builds 2",
        r"TypeError: cannot build a TransformerBlock from str",
        r"ValueError: not supported yet: YaRN rotary embeddings \(position_embedding_type='yarn'\)",
        r"ValueError: not supported yet: GPTModel.forward\(output_processor=...\)",
        r"ValueError: normalization='BatchNorm' is not supported",
    ]
    assert len(messages) == len(expected)
    for message, pattern in zip(messages, expected):
        assert message is not None, pattern
        assert re.match(pattern, message), (pattern, message)


def test_spec_errors():
    from megatron.core.models.gpt.moe_module_specs import (
        get_inference_optimized_moe_spec,
        get_moe_module_spec_for_backend,
    )

    with pytest.raises(ValueError, match=r"get_moe_module_spec_for_backend needs num_experts"):
        get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=None)
    with pytest.raises(ValueError, match=r"not supported yet: multi-latent attention"):
        get_gpt_layer_local_spec(multi_latent_attention=True)
    with pytest.warns(UserWarning, match=r"fp8 argument of get_gpt_layer_local_spec is deprecated and ignored"):
        get_gpt_layer_local_spec(fp8="e4m3")  # as in Megatron: FP8 is the config's business
    with pytest.raises(ValueError, match=r"not supported yet: Kitchen quantised layers .*use_kitchen=True"):
        get_gpt_layer_local_spec(use_kitchen=True)
    with pytest.raises(ValueError, match=r"not supported yet: multi-latent attention"):
        get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)
    with pytest.raises(ValueError, match=r"not supported yet: Kitchen quantised layers .*use_kitchen=True"):
        get_gpt_layer_with_transformer_engine_spec(use_kitchen=True)
    with pytest.raises(ValueError, match=r"not supported yet: inference-optimized layer specs"):
        get_gpt_layer_with_inference_spec()
    with pytest.raises(ValueError, match=r"not supported yet: the inference-optimized MoE spec"):
        get_inference_optimized_moe_spec()


def _block_spec_builds_the_same_model():
    parallel_state.initialize_model_parallel(1)
    config = build_config(1, False, {"normalization": "RMSNorm"})
    block_spec = get_gpt_decoder_block_spec(config, False, normalization="RMSNorm")
    model = GPTModel(config, block_spec, vocab_size=VOCAB, max_sequence_length=8)
    return sorted(name for name, _ in model.named_parameters()), type(model.decoder.final_layernorm).__name__


def test_decoder_block_spec():
    names, norm = run_distributed(1, _block_spec_builds_the_same_model)[0]
    assert norm == "RMSNorm"
    assert "decoder.layers.1.mlp.linear_fc2.weight" in names
    assert "decoder.final_layernorm.bias" not in names  # RMSNorm has no bias


def _unset_size_errors():
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1)
    spec = get_gpt_layer_local_spec()
    # Megatron's 0 defaults construct (a settings-only config); building a model from them does not.
    no_hidden = TransformerConfig(num_layers=2, num_attention_heads=4)
    no_heads = TransformerConfig(num_layers=2, hidden_size=8, kv_channels=2)
    return [
        _capture(lambda: GPTModel(no_hidden, spec, vocab_size=VOCAB, max_sequence_length=8)),
        _capture(lambda: TransformerBlock(no_hidden, spec)),
        _capture(lambda: HybridStack(no_hidden, HybridStackSubmodules(), layer_type_list=["M"])),
        _capture(lambda: SelfAttention(no_heads, spec.submodules.self_attention.submodules, 1, AttnMaskType.causal)),
    ]


def test_unset_model_sizes_are_refused_when_the_model_is_built():
    messages = run_distributed(1, _unset_size_errors)[0]
    expected = [
        r"ValueError: GPTModel cannot be built with hidden_size=0: TransformerConfig accepts 0 as 'not set'",
        r"ValueError: TransformerBlock cannot be built with hidden_size=0",
        r"ValueError: HybridStack cannot be built with hidden_size=0",
        r"ValueError: SelfAttention cannot be built with num_attention_heads=0, num_query_groups=0",
    ]
    for message, pattern in zip(messages, expected):
        assert message is not None and re.match(pattern, message), (pattern, message)
