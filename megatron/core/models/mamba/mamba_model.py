"""MambaModel: Megatron-Core's earlier name of :class:`HybridModel`, kept so code written for it still runs."""

from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.spec_utils import ModuleSpec


class MambaModel(HybridModel):
    """:class:`HybridModel` whose stack spec is passed as ``mamba_stack_spec`` (the old keyword); every other
    argument is HybridModel's."""

    def __init__(self, *args, mamba_stack_spec: ModuleSpec = None, **kwargs):
        if mamba_stack_spec is not None:
            if "hybrid_stack_spec" in kwargs or len(args) > 1:
                raise ValueError("MambaModel got both mamba_stack_spec and hybrid_stack_spec; give one of them")
            kwargs["hybrid_stack_spec"] = mamba_stack_spec
        super().__init__(*args, **kwargs)
