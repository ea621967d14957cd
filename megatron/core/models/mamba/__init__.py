"""Megatron-Core's earlier name of the hybrid model package (``megatron.core.models.hybrid``)."""

from megatron.core.models.mamba.mamba_model import MambaModel  # noqa: F401
