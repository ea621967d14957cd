"""Heterogeneous transformers (layers with different configurations): not built by megatron-lite."""
