"""Enums shared by the transformer modules (Megatron-Core's names and values)."""

import enum

from megatron.core.enums import ModelType  # noqa: F401  (Megatron exposes it here too)


class LayerType(enum.Enum):
    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class AttnBackend(enum.Enum):
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
