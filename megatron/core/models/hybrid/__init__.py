"""Hybrid Mamba / attention / MLP language models (Megatron-Core models.hybrid)."""
