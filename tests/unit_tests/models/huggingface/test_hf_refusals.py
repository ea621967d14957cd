"""What the converter refuses, each with a message naming it, before anything is written."""

import argparse
import json
import os
import shutil

import pytest
import torch

from megatron.core.models.huggingface import UnsupportedHFModelError, save_megatron_checkpoint_from_hf
from megatron.core.models.huggingface.config import settings_from_checkpoint_args
from megatron.core.models.huggingface.families import family_for_settings
from tests.unit_tests.models.huggingface.hf_test_models import CONFIGS, save_hf_model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_refusal_sources")
    return {family: save_hf_model(family, str(root / family)) for family in ("gpt2", "llama", "qwen2")}


def _variant(sources, tmp_path, family, config_changes=None, tensors=None):
    """A copy of a family's HF directory with config.json entries changed and, with ``tensors``, the weights
    replaced by ``tensors(source_state_dict)``."""
    from safetensors.torch import load_file, save_file

    directory = str(tmp_path / "hf")
    shutil.copytree(sources[family], directory)
    path = os.path.join(directory, "config.json")
    with open(path) as file:
        config = json.load(file)
    config.update(config_changes or {})
    with open(path, "w") as file:
        json.dump(config, file)
    if tensors is not None:
        weights = os.path.join(directory, "model.safetensors")
        save_file(tensors(load_file(weights)), weights)
    return directory


def _refused(hf_dir, tmp_path, match, **kwargs):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        save_megatron_checkpoint_from_hf(hf_dir, str(out), **kwargs)
    assert not out.exists(), "nothing may be written before a refusal"


def _config_only(tmp_path, config):
    directory = tmp_path / "config_only"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize(
    "architecture, match",
    [
        ("FooForCausalLM", "unknown architecture 'FooForCausalLM' in config.json; supported: "),
        (
            "NemotronHForCausalLM",
            "NemotronHForCausalLM: config.json has neither 'layers_block_type' nor 'hybrid_override_pattern'",
        ),
    ],
)
def test_architecture_refused(tmp_path, architecture, match):
    _refused(_config_only(tmp_path, {"architectures": [architecture]}), tmp_path, match)


LLAMA = {key: value for key, value in CONFIGS["llama"].items() if key != "model_type"}


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            r"LlamaForCausalLM: rope_type = 'yarn' is not supported",
        ),
        (
            {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
            r"rope_type = 'linear' is not supported",
        ),
        (
            {"rope_parameters": {**CONFIGS["llama"]["rope_parameters"], "low_freq_factor": 2.0}},
            r"rope_parameters\['low_freq_factor'\] = 2.0 is not supported; Megatron's Llama-3 RoPE scaling",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act = 'gelu' is not supported"),
        ({"attention_bias": True}, r"attention_bias = True is not supported"),
        ({"dtype": "float64"}, r"dtype = 'float64' is not supported"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
        ({"hidden_size": None}, r"config.json has no 'hidden_size'"),
    ],
)
def test_llama_config_values_refused(tmp_path, changes, match):
    _refused(_config_only(tmp_path, {**LLAMA, **changes}), tmp_path, match)


def test_sliding_window_refused(tmp_path):
    mistral = {**{k: v for k, v in CONFIGS["mistral"].items() if k != "model_type"}, "sliding_window": 16}
    _refused(_config_only(tmp_path, mistral), tmp_path, r"MistralForCausalLM: sliding_window = 16 is not supported")
    qwen2 = {
        **{k: v for k, v in CONFIGS["qwen2"].items() if k != "model_type"},
        "use_sliding_window": True,
        "sliding_window": 32,
    }
    shutil.rmtree(tmp_path / "config_only")
    _refused(_config_only(tmp_path, qwen2), tmp_path, r"Qwen2ForCausalLM: sliding_window = 32 is not supported")


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx = True is not supported"),
        ({"reorder_and_upcast_attn": True}, r"reorder_and_upcast_attn = True is not supported"),
        ({"activation_function": "relu"}, r"activation_function = 'relu' is not supported; use one of"),
    ],
)
def test_gpt2_config_values_refused(tmp_path, changes, match):
    gpt2 = {key: value for key, value in CONFIGS["gpt2"].items() if key != "model_type"}
    _refused(_config_only(tmp_path, {**gpt2, **changes}), tmp_path, match)


def test_tied_config_with_an_output_layer_refused(sources, tmp_path):
    hf_dir = _variant(sources, tmp_path, "llama", {"tie_word_embeddings": True})
    _refused(hf_dir, tmp_path, "says tie_word_embeddings=true but the checkpoint holds its own lm_head.weight")


def test_untied_config_without_an_output_layer_refused(sources, tmp_path):
    hf_dir = _variant(sources, tmp_path, "qwen2", {"tie_word_embeddings": False})
    _refused(hf_dir, tmp_path, "says tie_word_embeddings=false but the checkpoint has no lm_head.weight")


def test_missing_tensor_refused(sources, tmp_path):
    def drop(state):
        del state["model.layers.1.mlp.up_proj.weight"]
        return state

    hf_dir = _variant(sources, tmp_path, "llama", tensors=drop)
    _refused(hf_dir, tmp_path, r"tensors missing from the checkpoint: \['model.layers.1.mlp.up_proj.weight'\]")


def test_unexpected_tensor_refused(sources, tmp_path):
    def add(state):
        state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
        return state

    hf_dir = _variant(sources, tmp_path, "qwen2", tensors=add)
    _refused(
        hf_dir,
        tmp_path,
        r"no place in the qwen2 mapping \(nothing is dropped silently\): "
        r"\['model.layers.0.self_attn.q_norm.weight'\]",
    )


def test_gpt2_files_without_the_transformer_prefix_are_read(sources, tmp_path):
    """Hub GPT-2 files name tensors "h.0..." and carry causal-mask buffers: both are understood, not refused."""

    def strip(state):
        renamed = {name[len("transformer.") :]: tensor for name, tensor in state.items()}
        renamed["h.0.attn.bias"] = torch.ones(1, 1, 32, 32).tril()
        return renamed

    from megatron.core.models.huggingface.conversion import open_hf_model

    family, _, _, reader, rules = open_hf_model(_variant(sources, tmp_path, "gpt2", tensors=strip))
    assert family.name == "gpt2" and "transformer.h.1.mlp.c_fc.weight" in reader.names()


def test_pickled_weights_refused(sources, tmp_path):
    hf_dir = _variant(sources, tmp_path, "llama")
    os.rename(os.path.join(hf_dir, "model.safetensors"), os.path.join(hf_dir, "pytorch_model.bin"))
    _refused(hf_dir, tmp_path, r"no model.safetensors or model.safetensors.index.json .*only safetensors checkpoints")


def test_missing_config_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    _refused(str(tmp_path / "empty"), tmp_path, r"empty: no config.json")


def test_target_layout_refused(sources, tmp_path):
    _refused(
        sources["llama"],
        tmp_path,
        r"--target-tensor-parallel-size 4 does not divide the 2 key/value heads",
        target_tensor_parallel_size=4,
    )
    _refused(
        sources["llama"],
        tmp_path,
        r"--target-pipeline-parallel-size 3 does not divide the 2 layers",
        target_pipeline_parallel_size=3,
    )


def _megatron_args(**changes):
    values = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=64,
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        padded_vocab_size=128,
        ffn_hidden_size=64,
    )
    values.update(changes)
    return argparse.Namespace(**values)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"qk_layernorm": True}, "uses qk_layernorm=True, which no supported Hugging Face family has"),
        ({"layernorm_zero_centered_gamma": True}, "uses layernorm_zero_centered_gamma=True, which no supported"),
        ({"apply_layernorm_1p": True}, "uses apply_layernorm_1p=True, which no supported"),
        ({"num_experts": 8, "moe_router_enable_expert_bias": True}, "uses moe_router_enable_expert_bias=True"),
        ({"rotary_percent": 0.5}, "rotary_percent=0.5 has no mapping"),
        ({"hidden_size": None}, r"the checkpoint's arguments lack \['hidden_size'\]"),
    ],
)
def test_export_of_unmappable_checkpoint_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        settings_from_checkpoint_args(_megatron_args(**changes))


def test_export_family_inference():
    assert family_for_settings(settings_from_checkpoint_args(_megatron_args())).name == "llama"
    assert family_for_settings(settings_from_checkpoint_args(_megatron_args(add_qkv_bias=True))).name == "qwen2"
    with pytest.raises(UnsupportedHFModelError, match="no Hugging Face family matches this model .*--hf-architecture"):
        family_for_settings(settings_from_checkpoint_args(_megatron_args(position_embedding_type="none")))


def _load_into_model_with_extra_parameters(hf_dir):
    """A model with q/k layernorm has parameters the HF Llama lacks: loading names the first one."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.huggingface import load_hf_weights, read_hf_config, settings_from_hf_config
    from megatron.core.models.huggingface.config import gpt_model_kwargs, transformer_config_from_settings

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    _, settings = settings_from_hf_config(read_hf_config(hf_dir))
    kwargs = gpt_model_kwargs(settings)

    kwargs["transformer_layer_spec"] = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(transformer_config_from_settings(settings, qk_layernorm=True), **kwargs)
    try:
        load_hf_weights(model, hf_dir)
    except ValueError as error:
        return str(error)
    return None


def test_in_memory_load_refuses_parameters_without_a_source(sources):
    from tests.unit_tests.test_utilities import run_distributed

    message = run_distributed(1, _load_into_model_with_extra_parameters, sources["llama"])[0]
    assert message is not None and message.startswith(
        "model parameter decoder.layers.0.self_attention.q_layernorm.weight has no source in the llama mapping"
    )
