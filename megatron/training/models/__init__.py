"""Model configs and builders (Megatron-LM 0.19's ``megatron.training.models``): ``GPTModelConfig`` /
``HybridModelConfig`` describe a model, their builders build its stages and wrap them for training."""

from megatron.training.models.base import ModelBuilder, ModelConfig, Serializable, compose_hooks
from megatron.training.models.dist_utils import build_virtual_pipeline_stages, unimodal_build_distributed_models
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig
from megatron.training.models.hybrid import HybridModelBuilder, HybridModelConfig

# Megatron's older names of the hybrid model's config and builder.
MambaModelConfig = HybridModelConfig
MambaModelBuilder = HybridModelBuilder

__all__ = [
    "ModelBuilder",
    "ModelConfig",
    "Serializable",
    "compose_hooks",
    "build_virtual_pipeline_stages",
    "unimodal_build_distributed_models",
    "HybridModelConfig",
    "HybridModelBuilder",
    "MambaModelConfig",
    "MambaModelBuilder",
    "GPTModelConfig",
    "GPTModelBuilder",
]
