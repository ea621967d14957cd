"""Model-level enums (Megatron-Core's names and values)."""

import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1
