"""Enums shared by the transformer modules (Megatron-Core's names and values)."""

import enum

# Megatron also exposes ModelType here; it is the same class as megatron.core.enums.ModelType, so model types
# compare equal whichever module a caller imported them from.
from megatron.core.enums import ModelType  # noqa: F401


class LayerType(enum.Enum):
    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


class AttnBackend(enum.Enum):
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


# The CUDA-graph enums name what a config's cuda_graph_modules / cuda_graph_scope /
# inference_cuda_graph_scope select; this project captures no CUDA graphs, so they are vocabulary only.
class CudaGraphModule(enum.Enum):
    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6


class CudaGraphScope(enum.Enum):
    full_iteration = 1
    attn = 2
    mlp = 3
    moe = 4
    moe_router = 5
    moe_preprocess = 6
    mamba = 7
    full_iteration_inference = 8


class InferenceCudaGraphScope(enum.Enum):
    none = 1
    layer = 2
    block = 3


# A tuple, not an enum: TransformerConfig.cp_comm_type holds these strings (or a list of them, one per layer).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""The values of ``TransformerConfig.cp_comm_type`` (Megatron's)."""
