"""Model-level enums (Megatron-Core's names and values)."""

import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1


class Fp8Recipe(str, enum.Enum):
    """FP8 scaling recipes Megatron-Core names (``--fp8-recipe``); FP8 training itself is not built here yet."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"


class Fp4Recipe(str, enum.Enum):
    """FP4 scaling recipes Megatron-Core names (``--fp4-recipe``); FP4 training itself is not built here yet."""

    nvfp4 = "nvfp4"
    custom = "custom"
