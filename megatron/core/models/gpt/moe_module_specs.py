"""Layer-spec pieces for mixture-of-experts MLPs: :class:`MoELayer` with its router, experts and shared experts.

``moe_grouped_gemm=True`` picks :class:`TEGroupedMLP` (one grouped GEMM per projection, parameters
``mlp.experts.linear_fc1.weight<i>``), otherwise :class:`SequentialMLP` (one MLP per expert); both store the
checkpoint keys ``mlp.experts.experts.linear_fc1.weight``, as Megatron does, and are built from the backend's modules
(:meth:`BackendSpecProvider.grouped_mlp_modules`). ``use_te=True`` builds them in Transformer Engine's checkpoint
layout (:class:`TELayoutSpecProvider`).
"""

from typing import Optional

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider, TELayoutSpecProvider
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.te_layout import announce_te_layout
from megatron.core.transformer.transformer_layer import MlpBuilder


def get_moe_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
) -> MlpBuilder:
    """The MoE MLP spec: Transformer Engine's checkpoint layout with ``use_te`` (this project's modules, see
    :mod:`megatron.core.transformer.te_layout`), else the local modules."""
    if use_te:
        announce_te_layout()
        return get_moe_module_spec_for_backend(TELayoutSpecProvider(), num_experts, moe_grouped_gemm)
    return get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts, moe_grouped_gemm)


def get_moe_module_spec_for_backend(
    backend: BackendSpecProvider,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    use_te_activation_func: bool = False,
) -> MlpBuilder:
    """MoELayer with TopKRouter, ``backend``'s linears for the experts (grouped linears with
    ``moe_grouped_gemm``) and a SharedExpertMLP (built only when ``moe_shared_expert_intermediate_size`` is set).
    ``num_experts`` must be given (the config's ``num_moe_experts``)."""
    if num_experts is None:
        raise ValueError("get_moe_module_spec_for_backend needs num_experts (the config's num_moe_experts)")
    dense_linears = MLPSubmodules(
        linear_fc1=backend.column_parallel_linear(),
        linear_fc2=backend.row_parallel_linear(),
        activation_func=backend.activation_func(),
    )
    experts = backend.grouped_mlp_modules(bool(moe_grouped_gemm))
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=experts,
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=dense_linears),
            router=TopKRouter,
        ),
    )


def get_inference_optimized_moe_spec() -> MlpBuilder:
    """The inference-optimised MoE layer (CUDA-graphed routing into dense ``[tokens, topk]`` outputs) belongs to
    the inference engine, which is not built yet: always a ValueError pointing at :func:`get_moe_module_spec`."""
    raise ValueError(
        "not supported yet: the inference-optimized MoE spec; build MoE layers with get_moe_module_spec(use_te=False)"
    )
