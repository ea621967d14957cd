"""TransformerConfig / ModelParallelConfig: derived defaults and every validation message."""

import warnings

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import warn_once

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=8)


def make(**overrides):
    return TransformerConfig(**{**BASE, **overrides})


def test_derived_defaults():
    config = make(tensor_model_parallel_size=2)
    assert config.ffn_hidden_size == 256
    assert config.kv_channels == 8
    assert config.num_query_groups == 8
    assert config.expert_tensor_parallel_size == 2
    assert config.autocast_dtype == torch.float32
    assert config.microbatch_group_size_per_vp_stage == 1
    # Output projections are initialised with std / sqrt(2 * num_layers).
    weight = torch.empty(2000, 200)
    config.output_layer_init_method(weight)
    assert abs(weight.std().item() - 0.02 / 2) < 1e-3


def test_selective_recompute_defaults_to_core_attention():
    assert make(recompute_granularity="selective").recompute_modules == ["core_attn"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_layers": -1}, r"num_layers must be a positive integer \(or 0, not set yet\), got -1"),
        ({"hidden_size": -1}, r"hidden_size must be a positive integer \(or 0, not set yet\), got -1"),
        ({"num_layers": 0}, r"num_layers=0 leaves the default output_layer_init_method undefined"),
        ({"num_attention_heads": 0}, r"num_attention_heads=0 \(not set\) leaves kv_channels undefined"),
        ({"num_attention_heads": 6}, r"hidden_size \(64\) must be divisible by num_attention_heads \(6\)"),
        ({"num_query_groups": 3}, r"num_attention_heads \(8\) must be a multiple of num_query_groups \(3\)"),
        (
            {"tensor_model_parallel_size": 16},
            r"num_attention_heads \(8\) must be divisible by tensor_model_parallel_size \(16\)",
        ),
        (
            {"tensor_model_parallel_size": 4, "num_query_groups": 2},
            r"num_query_groups \(2\) must be divisible by tensor_model_parallel_size \(4\)",
        ),
        (
            {"tensor_model_parallel_size": 2, "ffn_hidden_size": 15},
            r"ffn_hidden_size \(15\) must be divisible by tensor_model_parallel_size \(2\)",
        ),
        ({"normalization": "BatchNorm"}, r"normalization='BatchNorm' is not supported"),
        ({"hidden_dropout": 1.0}, r"hidden_dropout must be in \[0, 1\), got 1.0"),
        ({"recompute_granularity": "partial"}, r"recompute_granularity='partial' is not valid"),
        ({"recompute_granularity": "full"}, r"recompute_granularity='full' needs recompute_method"),
        (
            {"recompute_granularity": "full", "recompute_method": "uniform"},
            r"recompute_granularity='full' needs recompute_num_layers >= 1, got None",
        ),
        (
            {"recompute_granularity": "selective", "recompute_num_layers": 1},
            r"recompute_num_layers must be None with recompute_granularity='selective'",
        ),
        (
            {"recompute_granularity": "selective", "recompute_modules": ["moe_act"]},
            r"recompute_modules \['moe_act'\] are not supported",
        ),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": 1,
                "distribute_saved_activations": True,
                "sequence_parallel": True,
                "tensor_model_parallel_size": 2,
            },
            r"distribute_saved_activations cannot be combined with sequence_parallel",
        ),
        ({"window_size": (4,)}, r"window_size=\(4,\) \(--window-size\) must be two integers \(left, right\)"),
        (
            {"window_size": (4, 0), "context_parallel_size": 2},
            r"sliding-window attention is not supported with context_parallel_size=2",
        ),
        ({"multi_latent_attention": True}, r"not supported yet: multi-latent attention \(multi_latent_attention=True"),
        ({"fp8": "hybrid", "fp8_param": True}, r"not supported yet: FP8 parameters, .*\(fp8_param=True\)"),
        ({"fp8": "hybrid", "fp8_recipe": "custom"}, r"fp8_recipe='custom' is not supported yet; choose one of"),
        ({"fp8": "fp4"}, r"fp8='fp4' is not an FP8 format; choose one of \('e4m3', 'hybrid'\)"),
        (
            {"fp8": "hybrid", "fp8_recipe": "mxfp8", "ffn_hidden_size": 48},
            r"fp8_recipe='mxfp8' scales blocks of 32 elements .* ffn_hidden_size / tensor_model_parallel_size = 48 "
            r"is not a multiple of 32",
        ),
        ({"sequence_parallel": True}, r"sequence_parallel=True needs tensor_model_parallel_size > 1"),
        ({"tensor_model_parallel_size": 0}, r"tensor_model_parallel_size must be a positive integer, got 0"),
        ({"pipeline_model_parallel_size": 2}, r"pipeline_dtype must be set when pipeline_model_parallel_size > 1"),
        (
            {"virtual_pipeline_model_parallel_size": 2},
            r"virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1",
        ),
        ({"fp16": True, "bf16": True}, r"fp16 and bf16 are both set"),
        (
            {"hierarchical_context_parallel_sizes": [2, 2]},
            r"hierarchical_context_parallel_sizes=\[2, 2\] must be positive integers whose product is "
            r"context_parallel_size=1",
        ),
        ({"context_parallel_size": 2, "cp_comm_type": "ring"}, r"cp_comm_type='ring' is not one of p2p, all_gather"),
        (
            {"context_parallel_size": 2, "cp_comm_type": ["p2p"]},
            r"cp_comm_type is a list of 1 values but the model has num_layers=2",
        ),
        (
            {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p"},
            r"cp_comm_type='a2a\+p2p' needs hierarchical_context_parallel_sizes=\[a2a size, p2p size\]",
        ),
        (
            {"context_parallel_size": 16, "cp_comm_type": "a2a"},
            r"cp_comm_type='a2a' scatters heads over 16 context-parallel ranks, but num_attention_heads=8",
        ),
    ],
)
def test_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        make(**overrides)


def test_fusion_switches_warn_once_and_are_accepted():
    warn_once.cache_clear()
    with pytest.warns(UserWarning, match="memory_efficient_layer_norm=True: no fused kernel is available here"):
        make(memory_efficient_layer_norm=True)


def test_fusions_of_megatron_core_fusions_are_accepted_without_a_notice():
    warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = make(masked_softmax_fusion=True, bias_dropout_fusion=True)
    assert config.masked_softmax_fusion and config.bias_dropout_fusion


def test_model_parallel_config_alone():
    config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert config.expert_tensor_parallel_size == 2
    with pytest.raises(ValueError, match="sequence_parallel=True needs tensor_model_parallel_size > 1"):
        ModelParallelConfig(sequence_parallel=True)


def test_megatrons_zero_defaults_construct_as_unset_sizes():
    # Megatron 0.19 defaults num_layers/hidden_size/num_attention_heads to 0 and constructs a settings-only config
    # such as TransformerConfig(num_attention_heads=1, num_layers=1) (its DDP and optimizer tests do).
    settings_only = TransformerConfig(num_attention_heads=1, num_layers=1)
    assert (settings_only.hidden_size, settings_only.ffn_hidden_size, settings_only.kv_channels) == (0, 0, 0)
    no_heads = TransformerConfig(num_layers=2, hidden_size=8, kv_channels=2)
    assert (no_heads.num_attention_heads, no_heads.num_query_groups) == (0, 0)
    no_layers = TransformerConfig(hidden_size=8, num_attention_heads=2, output_layer_init_method=lambda w: w)
    assert no_layers.num_layers == 0
    assert make(num_query_groups=0).num_query_groups == 0
    # Sizes a model needs are checked when it is built.
    from megatron.core.transformer.config_validation import require_model_sizes

    require_model_sizes(make(), "GPTModel", attention=True)
    with pytest.raises(ValueError, match=r"GPTModel cannot be built with hidden_size=0: TransformerConfig accepts 0"):
        require_model_sizes(settings_only, "GPTModel")
    with pytest.raises(ValueError, match=r"SelfAttention cannot be built with num_attention_heads=0, num_query_groups"):
        require_model_sizes(no_heads, "SelfAttention", attention=True)
