"""Megatron-Core's import path for the DDP buffer layout (the code is in ``megatron.core.distributed.param_layout``,
below the optimizer, because the DDP buffers use it)."""

from megatron.core.distributed.param_layout import (  # noqa: F401
    BufferKey,
    FullParamLayout,
    PerBufferParamLayout,
    bucket_end_divisor,
    pad_bucket_end,
    pad_param_start,
    pad_to_divisor,
)
