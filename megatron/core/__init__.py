"""megatron.core: the library (parallel state, tensor/pipeline parallelism, transformer models, data, optimizers)."""
