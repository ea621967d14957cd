"""NemotronH (``NemotronHForCausalLM`` -> HybridModel) specifics. The logits at TP1/TP2/PP2 and the bit-identical
export run with the other families in test_hf_conversion.py (its tiny model is in hf_test_models.CONFIGS); here: the
config mapping, the checkpoint's keys and args, and every refusal's message."""

import os

import pytest
import torch

from tests.unit_tests.models.huggingface.hf_test_models import (
    CONFIGS,
    VOCAB,
    hf_logits,
    relative_error,
    save_hf_model,
    tokens,
)
from tests.unit_tests.test_utilities import run_distributed

NEMOTRON_H = {key: value for key, value in CONFIGS["nemotron_h"].items() if key != "model_type"}


def _settings(**overrides):
    from megatron.core.models.huggingface import settings_from_hf_config

    return settings_from_hf_config({**NEMOTRON_H, **overrides})


def test_config_maps_to_hybrid_settings():
    family, s = _settings()
    assert family.name == "nemotron_h" and family.model_type == "hybrid"
    assert (s.hybrid_layer_pattern, s.num_layers, s.position_embedding_type) == ("M*-M", 4, "none")
    assert (s.mamba_state_dim, s.mamba_head_dim, s.mamba_num_groups, s.mamba_num_heads) == (8, 8, 2, 8)
    assert (s.squared_relu, s.swiglu, s.normalization, s.layernorm_epsilon) == (True, False, "RMSNorm", 1e-5)
    assert (s.ffn_hidden_size, s.num_query_groups, s.kv_channels) == (48, 2, 8)
    assert s.untie_embeddings_and_output_weights and not s.add_bias_linear
    # older config files give the pattern as a string
    old = {key: value for key, value in NEMOTRON_H.items() if key != "layers_block_type"}
    from megatron.core.models.huggingface import settings_from_hf_config

    assert settings_from_hf_config({**old, "hybrid_override_pattern": "M*-M"})[1] == s
    renamed = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv"}
    legacy = {renamed.get(key, key): value for key, value in NEMOTRON_H.items()}
    assert settings_from_hf_config(legacy)[1] == s
    from megatron.core.models.huggingface import UnsupportedHFModelError

    with pytest.raises(UnsupportedHFModelError, match="conv_kernel = 3"):
        settings_from_hf_config({**legacy, "mamba_d_conv": 3})


def test_transformer_config_and_model_from_settings():
    from megatron.core.activations import squared_relu
    from megatron.core.models.huggingface import hybrid_model_kwargs, transformer_config_from_settings

    _, s = _settings()
    config = transformer_config_from_settings(s)
    assert config.activation_func is squared_relu and not config.gated_linear_unit
    assert (config.is_hybrid_model, config.mamba_num_heads, config.mamba_num_groups) == (True, 8, 2)
    kwargs = hybrid_model_kwargs(s, tensor_parallel_size=2)
    assert kwargs["hybrid_layer_pattern"] == "M*-M" and kwargs["vocab_size"] == 256
    assert not kwargs["share_embeddings_and_output_weights"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            {"layers_block_type": ["linear_attention", "moe", "mlp", "linear_attention"]},
            "MoE layers ('moe' / 'E' in the layer pattern) = 'ME-M' is not supported; the hybrid's MoE layers are not "
            "mapped yet",
        ),
        (
            {"layers_block_type": None, "hybrid_override_pattern": "M*EM"},
            "MoE layers ('moe' / 'E' in the layer pattern) = 'M*EM' is not supported",
        ),
        ({"layers_block_type": None, "hybrid_override_pattern": "M*G"}, "hybrid_override_pattern symbol = 'G'"),
        ({"layers_block_type": ["linear_attention", "cross_attention"]}, "layers_block_type entry = 'cross_attention'"),
        ({"layers_block_type": None}, "config.json has neither 'layers_block_type' nor 'hybrid_override_pattern'"),
        (
            {"mlp_hidden_act": "gelu"},
            "mlp_hidden_act = 'gelu' is not supported; the MLP layers map to Megatron's squared ReLU",
        ),
        ({"mamba_hidden_act": "relu"}, "mamba_hidden_act = 'relu' is not supported"),
        ({"use_bias": True}, "use_bias = True is not supported; Megatron's Mamba in/out projections have no bias"),
        ({"mlp_bias": True}, "mlp_bias = True is not supported"),
        ({"use_conv_bias": False}, "use_conv_bias = False is not supported"),
        (
            {"conv_kernel": 3},
            "conv_kernel = 3 is not supported; Megatron's hybrid spec builds the Mamba conv with width 4",
        ),
        ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers = 1 is not supported; multi-token prediction"),
        ({"sliding_window": 16}, "sliding_window = 16 is not supported"),
        (
            {"layer_norm_epsilon": 1e-6},
            "layer_norm_epsilon = 1e-06 is not supported; Megatron's Mamba mixer fixes its "
            "gated RMSNorm's epsilon at 1e-5",
        ),
        ({"mamba_num_heads": None}, "NemotronHForCausalLM: config.json has no 'mamba_num_heads'"),
        (
            {"head_dim": None, "attention_head_dim": 16},
            "attention_head_dim (without head_dim) = 16 is not supported; transformers reads head_dim (default 128)",
        ),
    ],
)
def test_unmapped_config_values_are_refused(overrides, match):
    from megatron.core.models.huggingface import UnsupportedHFModelError

    with pytest.raises(
        UnsupportedHFModelError,
        match=match.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*").replace("'", "'"),
    ):
        _settings(**overrides)


def test_model_type_and_tensor_parallel_refusals(tmp_path):
    from megatron.core.models.huggingface import UnsupportedHFModelError, save_megatron_checkpoint_from_hf

    hf_dir = save_hf_model("nemotron_h", str(tmp_path / "nh"), num_key_value_heads=4)
    out = str(tmp_path / "out")
    with pytest.raises(
        UnsupportedHFModelError,
        match="--model-type GPT, but .* holds a nemotron_h model "
        r"\(NemotronHForCausalLM\), which converts as --model-type hybrid",
    ):
        save_megatron_checkpoint_from_hf(hf_dir, out, model_type="GPT")
    with pytest.raises(ValueError, match="--target-tensor-parallel-size 4 does not divide the 2 Mamba groups"):
        save_megatron_checkpoint_from_hf(hf_dir, out, 4, model_type="hybrid")
    assert not os.path.exists(out)


def test_unexpected_and_missing_tensors_are_refused(tmp_path):
    """An MoE-free config whose files hold a tensor the table has no place for (or lack one) is refused."""
    from safetensors.torch import load_file, save_file

    from megatron.core.models.huggingface import UnsupportedHFModelError
    from megatron.core.models.huggingface.conversion import open_hf_model

    hf_dir = save_hf_model("nemotron_h", str(tmp_path / "nh"))
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    save_file({**tensors, "mtp.layers.0.norm.weight": torch.ones(32)}, path, metadata={"format": "pt"})
    with pytest.raises(UnsupportedHFModelError, match=r"no place in the nemotron_h mapping .*mtp\.layers\.0"):
        open_hf_model(hf_dir)
    del tensors["backbone.layers.3.mixer.dt_bias"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        UnsupportedHFModelError,
        match=r"missing from the checkpoint: \['backbone.layers.3.mixer"
        r"\.dt_bias'\]",
    ):
        open_hf_model(hf_dir)


def _in_memory_logits(hf_dir, input_ids):
    from megatron.core import parallel_state as ps
    from megatron.core.models.huggingface import build_model_from_hf

    ps.initialize_model_parallel()
    model = build_model_from_hf(hf_dir, use_cpu_initialization=True).eval()
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
    with torch.no_grad():
        return model(input_ids, positions, None)[..., :VOCAB]


def test_tie_word_embeddings_is_untied_as_transformers_does(tmp_path):
    """transformers' NemotronH keeps its own lm_head even with tie_word_embeddings=true (and saves it): the
    conversion follows the model, not the flag, and gives its logits."""
    hf_dir = save_hf_model("nemotron_h", str(tmp_path / "tied"), tie_word_embeddings=True)
    assert _settings(tie_word_embeddings=True)[1].untie_embeddings_and_output_weights
    input_ids = tokens()
    logits = run_distributed(1, _in_memory_logits, hf_dir, input_ids)[0]
    assert relative_error(logits, hf_logits(hf_dir, input_ids)) <= 1e-5


def test_a_tied_megatron_hybrid_is_not_exported():
    import dataclasses

    from megatron.core.models.huggingface import FAMILIES, UnsupportedHFModelError

    _, s = _settings()
    tied = dataclasses.replace(s, untie_embeddings_and_output_weights=False)
    with pytest.raises(
        UnsupportedHFModelError,
        match="tied embeddings .* transformers' NemotronH always has its "
        "own lm_head; train the hybrid with --untie-embeddings",
    ):
        FAMILIES["nemotron_h"].hf_config_from_settings(tied)


def _convert(hf_dir, out):
    from megatron.core.models.huggingface import save_megatron_checkpoint_from_hf

    return save_megatron_checkpoint_from_hf(hf_dir, out, 2, 2, model_type="hybrid")


def test_converted_checkpoint_keys_and_args(tmp_path):
    """Megatron's hybrid layout: one key per layer, the Mamba in_proj / conv stored per segment, norms under the
    Transformer Engine names; args that rebuild the hybrid with --use-checkpoint-args."""
    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata

    hf_dir = save_hf_model("nemotron_h", str(tmp_path / "nh"))
    checkpoint = run_distributed(1, _convert, hf_dir, str(tmp_path / "megatron"))[0]
    stored = {
        key: tuple(entry.size)
        for key, entry in read_dcp_metadata(checkpoint).state_dict_metadata.items()
        if hasattr(entry, "size")
    }
    mamba = "decoder.layers.0.mixer."
    assert {stored[mamba + f"in_proj.weight.{n}"] for n in "zx"} == {(64, 32)}
    assert stored[mamba + "in_proj.weight.B"] == stored[mamba + "in_proj.weight.C"] == (16, 32)
    assert stored[mamba + "in_proj.weight.dt"] == (8, 32) and mamba + "in_proj.weight" not in stored
    assert stored[mamba + "conv1d.weight.x"] == (64, 1, 4) and stored[mamba + "conv1d.bias.C"] == (16,)
    assert stored[mamba + "in_proj.layer_norm_weight"] == (32,) and stored[mamba + "A_log"] == (8,)
    assert stored["decoder.layers.1.self_attention.linear_qkv.weight"] == ((4 + 2 * 2) * 8, 32)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in stored
    assert stored["decoder.layers.2.mlp.linear_fc1.weight"] == (48, 32)
    assert "decoder.layers.2.mlp.linear_fc1.layer_norm_weight" in stored
    assert stored["decoder.final_norm.weight"] == (32,) and stored["output_layer.weight"] == (256, 32)
    args = load_common_state_dict(checkpoint)["args"]
    assert (args.is_hybrid_model, args.hybrid_layer_pattern, args.squared_relu) == (True, "M*-M", True)
    assert (args.mamba_state_dim, args.mamba_head_dim, args.mamba_num_groups, args.mamba_num_heads) == (8, 8, 2, 8)
    assert (args.position_embedding_type, args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (
        "none",
        2,
        2,
    )
