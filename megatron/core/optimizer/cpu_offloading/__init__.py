"""Optimizer CPU offload (Megatron's ``megatron.core.optimizer.cpu_offloading``)."""

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

__all__ = ["HybridDeviceOptimizer"]
