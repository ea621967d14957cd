"""Megatron-Core's earlier name of the hybrid stack spec: ``mamba_stack_spec`` is ``hybrid_stack_spec``
(``--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec`` in old launch scripts)."""

from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

mamba_stack_spec = hybrid_stack_spec
