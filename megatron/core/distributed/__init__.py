"""Data-parallel training: DDP with contiguous bucketed gradient buffers, and finalize_model_grads."""

from megatron.core.distributed.finalize_model_grads import finalize_model_grads

__all__ = ["finalize_model_grads"]
