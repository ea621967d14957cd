"""Layer specs of heterogeneous GPT models: not built by megatron-lite."""
