"""Hugging Face interop: GPTModel settings from an HF ``config.json``, HF weights into a (TP/PP-sharded) model in
memory, and HF <-> Megatron checkpoint conversion (``tools/checkpoint/convert.py`` is the command line).

Supported families (one table each in ``families.py``): GPT-2, Llama (1/2/3, incl. Llama-3 RoPE scaling and GQA),
Mistral (without sliding window), Qwen2 (QKV bias), Mixtral (MoE; experts at their global index, so an EP-sharded
model loads too), NemotronH (Mamba-2 hybrid -> HybridModel; no MoE layers)."""

from megatron.core.models.huggingface.config import (
    gpt_model_kwargs,
    hybrid_model_kwargs,
    padded_vocab_size,
    read_hf_config,
    settings_from_hf_config,
    transformer_config_from_settings,
)
from megatron.core.models.huggingface.conversion import (
    build_gpt_model_from_hf,
    build_model_from_hf,
    export_megatron_checkpoint_to_hf,
    hf_state_dict_from_model,
    load_hf_weights,
    save_megatron_checkpoint_from_hf,
)
from megatron.core.models.huggingface.families import (
    FAMILIES,
    ModelSettings,
    UnsupportedHFModelError,
    family_for_architecture,
)

__all__ = [
    "FAMILIES",
    "ModelSettings",
    "UnsupportedHFModelError",
    "build_gpt_model_from_hf",
    "build_model_from_hf",
    "hybrid_model_kwargs",
    "export_megatron_checkpoint_to_hf",
    "family_for_architecture",
    "gpt_model_kwargs",
    "hf_state_dict_from_model",
    "load_hf_weights",
    "padded_vocab_size",
    "read_hf_config",
    "save_megatron_checkpoint_from_hf",
    "settings_from_hf_config",
    "transformer_config_from_settings",
]
