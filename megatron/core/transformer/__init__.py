"""Transformer building blocks: config, modules, layer specs (Megatron-Core's package face)."""

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "MLATransformerConfig",
    "MegatronModule",
    "ModuleSpec",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "build_module",
]
