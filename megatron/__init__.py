"""megatron-lite: Megatron-Core's and Megatron-LM's public API, runnable on CPU (gloo) and GPU (nccl)."""
