"""Megatron-Core 0.19's config fields: defaults, the not-supported-yet table, MLATransformerConfig, derived init
methods, kernel knobs; and the enums and activation the configs refer to."""

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import megatron.core.transformer

from megatron.core import parallel_state
from megatron.core.activations import fast_gelu
from megatron.core.enums import Fp4Recipe, Fp8Recipe
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.not_supported_yet import NOT_SUPPORTED_YET
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.utils import warn_once
from tests.unit_tests.test_utilities import run_distributed

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=8)
TABLE = [(feature, name) for feature, names in NOT_SUPPORTED_YET.items() for name in names]


def _default(config_class, name):
    field = next(f for f in dataclasses.fields(config_class) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _other_value(default):
    """A value different from ``default`` (its type does not matter: refusal comes before any other use)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "-other"
    if isinstance(default, list):
        return ["other"]
    return 2


def test_defaults_construct_without_errors_or_warnings():
    warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelParallelConfig()
        TransformerConfig(**BASE)
        MLATransformerConfig(**BASE)


def test_megatron_defaults_that_used_to_differ():
    config = TransformerConfig(**BASE)
    assert config.cpu_offloading_weights is False
    assert config.distribute_saved_activations is False
    assert config.offload_modules == [] and config.offload_modules is not TransformerConfig(**BASE).offload_modules


def test_every_table_field_is_a_config_field_listed_once():
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    names = [name for _, name in TABLE]
    assert sorted(set(names) - fields) == []
    assert len(names) == len(set(names))


@pytest.mark.parametrize("feature, name", TABLE, ids=[name for _, name in TABLE])
def test_unsupported_feature_field_is_refused_when_set(feature, name):
    config_class = (
        TransformerConfig if name in {f.name for f in dataclasses.fields(TransformerConfig)} else (MLATransformerConfig)
    )
    value = _other_value(_default(config_class, name))
    with pytest.raises(ValueError) as error:
        config_class(**BASE, **{name: value})
    assert str(error.value).startswith(f"not supported yet: {feature} ({name}={value!r})")
    assert "Leave these fields at their defaults" in str(error.value)


def test_model_parallel_config_alone_refuses_its_own_fields():
    with pytest.raises(
        ValueError, match=r"^not supported yet: hybrid context parallelism \(hybrid_context_parallel=Tr"
    ):
        ModelParallelConfig(hybrid_context_parallel=True)
    with pytest.raises(ValueError, match=r"CPU offloading of weights .* \(cpu_offloading_weights=True\)"):
        ModelParallelConfig(cpu_offloading_weights=True)


def test_one_error_names_every_unsupported_feature():
    with pytest.raises(ValueError) as error:
        TransformerConfig(**BASE, num_moe_experts=8, moe_latent_size=4, moe_token_dropping=True, mtp_num_layers=1)
    assert str(error.value).startswith(
        "not supported yet: MoE legacy token dropping (moe_token_dropping=True); MoE latent projections "
        "(moe_latent_size=4); "
        "multi-token prediction (mtp_num_layers=1). "
    )


def test_sub_options_megatron_ignores_until_their_feature_is_on_are_accepted():
    # Megatron-LM's command line passes these by default (--cp-comm-type p2p, --cuda-graph-modules []).
    config = TransformerConfig(**BASE, cp_comm_type="p2p", cuda_graph_modules=[])
    assert (config.cp_comm_type, config.cuda_graph_modules) == ("p2p", [])


def test_false_counts_as_an_unset_none_switch():
    # Megatron's own tests pass fp8=False for "no FP8"; fp4=True is still refused.
    assert TransformerConfig(**BASE, fp8=False).fp8 is False
    with pytest.raises(ValueError, match=r"^not supported yet: FP4 training \(fp4=True\)"):
        TransformerConfig(**BASE, fp4=True)


def test_query_key_layer_scaling_turns_on_fp32_softmax():
    config = TransformerConfig(**BASE, apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False)
    assert config.attention_softmax_in_fp32 is True
    assert TransformerConfig(**BASE, attention_softmax_in_fp32=False).attention_softmax_in_fp32 is False


def test_transformer_impl():
    assert TransformerConfig(**BASE, transformer_impl="local").transformer_impl == "local"
    with pytest.raises(ValueError, match=r"not supported yet: inference-optimised layers"):
        TransformerConfig(**BASE, transformer_impl="inference_optimized")
    with pytest.raises(ValueError, match=r"transformer_impl='te' is not valid"):
        TransformerConfig(**BASE, transformer_impl="te")


def test_kernel_knobs_are_accepted_with_one_warning():
    warn_once.cache_clear()
    with pytest.warns(UserWarning, match="symmetric_ar_type='two_shot': no fused kernel is available here"):
        config = TransformerConfig(**BASE, symmetric_ar_type="two_shot", tp_comm_bulk_wgrad=False)
    assert (config.symmetric_ar_type, config.tp_comm_bulk_wgrad) == ("two_shot", False)


def test_bf16_reduced_precision_matmul_switch():
    flag = torch.backends.cuda.matmul
    saved = flag.allow_bf16_reduced_precision_reduction
    try:
        flag.allow_bf16_reduced_precision_reduction = True
        TransformerConfig(**BASE, disable_bf16_reduced_precision_matmul=True)  # fp32 model: left alone
        assert flag.allow_bf16_reduced_precision_reduction is True
        TransformerConfig(**BASE, bf16=True, disable_bf16_reduced_precision_matmul=True)
        assert flag.allow_bf16_reduced_precision_reduction is False
    finally:
        flag.allow_bf16_reduced_precision_reduction = saved


def _std_of(init_method):
    weight = torch.empty(400, 500)
    torch.manual_seed(0)
    init_method(weight)
    return weight.std().item()


def test_embedding_init_method_follows_megatron():
    config = TransformerConfig(**BASE, init_method_std=0.05)
    assert config.embedding_init_method_std == 0.05
    assert abs(_std_of(config.embedding_init_method) - 0.05) < 1e-3

    separate = TransformerConfig(**BASE, embedding_init_method_std=1.0)
    assert abs(_std_of(separate.embedding_init_method) - 1.0) < 2e-2
    assert abs(_std_of(separate.init_method) - 0.02) < 1e-3

    def custom(tensor):
        return torch.nn.init.constant_(tensor, 0.5)

    assert TransformerConfig(**BASE, init_method=custom).embedding_init_method is custom
    assert TransformerConfig(**BASE, init_method=custom, embedding_init_method_std=0.3).embedding_init_method is not (
        custom
    )


def test_mla_config_constructs_with_megatron_defaults():
    config = MLATransformerConfig(**BASE)
    assert config.multi_latent_attention is True
    assert config.normalization == "RMSNorm"
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim) == (
        512,
        512,
        128,
        64,
    )
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings) == (
        "yarn",
        40,
        4096,
    )
    assert isinstance(config, TransformerConfig)
    assert megatron.core.transformer.MLATransformerConfig is MLATransformerConfig


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rope_type": "alibi"}, r"rope_type='alibi' is not valid; use one of \('rope', 'yarn'\)"),
        ({"kv_lora_rank": 0}, r"kv_lora_rank must be a positive integer, got 0"),
        ({"multi_latent_attention": False}, r"multi-latent attention \(multi_latent_attention=False\)"),
        ({"cache_mla_latents": True}, r"not supported yet: inference-only execution options \(cache_mla_latents"),
    ],
)
def test_mla_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        MLATransformerConfig(**BASE, **overrides)


def test_attention_refuses_to_build_from_an_mla_config():
    with pytest.raises(ValueError, match=r"^not supported yet: multi-latent attention \(multi_latent_attention=True\)"):
        submodules = SelfAttentionSubmodules(linear_qkv=None, core_attention=None, linear_proj=None)
        SelfAttention(MLATransformerConfig(**BASE), submodules, layer_number=1)


def _embedding_stds(overrides):
    parallel_state.initialize_model_parallel(1)
    config = TransformerConfig(**BASE, use_cpu_initialization=True, **overrides)
    torch.manual_seed(0)
    embedding = LanguageModelEmbedding(config, vocab_size=512, max_sequence_length=256)
    return embedding.word_embeddings.weight.std().item(), embedding.position_embeddings.weight.std().item()


def test_embeddings_are_initialised_with_embedding_init_method():
    default_stds = run_distributed(1, _embedding_stds, {})[0]
    separate_stds = run_distributed(1, _embedding_stds, {"embedding_init_method_std": 0.5})[0]
    assert all(abs(std - 0.02) < 2e-3 for std in default_stds), default_stds
    assert all(abs(std - 0.5) < 5e-2 for std in separate_stds), separate_stds


def test_plain_transformer_config_refuses_multi_latent_attention():
    with pytest.raises(ValueError, match=r"not supported yet: multi-latent attention \(multi_latent_attention=True\)"):
        TransformerConfig(**BASE, multi_latent_attention=True)


def test_fast_gelu_matches_its_formula():
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    expected = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    torch.testing.assert_close(fast_gelu(x), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast_gelu(x), F.gelu(x, approximate="tanh"), rtol=0, atol=1e-12)
    assert fast_gelu(torch.tensor([1.0], dtype=torch.float64)).item() == pytest.approx(0.8411919906082768, abs=1e-9)


def test_recipe_enums():
    assert [member.name for member in Fp8Recipe] == ["delayed", "tensorwise", "mxfp8", "blockwise", "custom"]
    assert [member.name for member in Fp4Recipe] == ["nvfp4", "custom"]
    # String enums: a config's "delayed" and Fp8Recipe.delayed are interchangeable, as in Megatron.
    assert Fp8Recipe("mxfp8") is Fp8Recipe.mxfp8 and Fp8Recipe.delayed == "delayed"
    assert Fp4Recipe.nvfp4 == "nvfp4"
