"""Megatron's optimizer stack: get_megatron_optimizer builds the right wrapper for a model and an OptimizerConfig.

Parameters are grouped by the overrides they match (``config_overrides``: ``{ParamKey: ParamGroupOverride}``); by
default (:func:`get_standard_config_overrides`) biases and 1-D parameters (norms) get no weight decay, and with
``decoupled_lr`` the input embedding and output layer get their own peak/min learning rate. Dense and expert
parameters get separate optimizers (their gradients live in different data-parallel groups), chained when both
exist.
"""

import logging
from typing import List, Optional

import torch

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32, get_grad_norm_fp32
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
    param_group_identifier_keys,
)

# _build_torch_optimizer and _get_param_groups stay importable from here (Megatron's module for _get_param_groups).
from megatron.core.optimizer.optimizer_builder import (
    ConfigOverrides,
    _build_optimizers,
    _build_torch_optimizer,
    _get_param_groups,
    _process_groups,
    check_config_overrides_consistency,
    get_standard_config_overrides,
    init_optimizer_state,
)
from megatron.core.optimizer.layer_wise_optimizer import (
    LayerWiseDistributedOptimizer,
    is_managed_by_layer_wise_optimizer,
)
from megatron.core.optimizer.muon import get_megatron_muon_optimizer
from megatron.core.optimizer.optimizer_config import (
    MUON_OPTIMIZERS,
    AdamOptimizerConfig,
    OptimizerConfig,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    SGDOptimizerConfig,
)
from megatron.core.optimizer_param_scheduler import (
    ParamGroupOverride,
    combine_param_group_overrides,
    param_group_override_to_tuple,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.fsdp_dtensor_checkpoint import get_global_unique_param_name  # noqa: F401
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_model_config, get_pg_rank, get_pg_size, is_te_min_version

# Megatron-Core sets this when the emerging-optimizers package (>= 0.2) is installed and builds Lion & co. from it.
# This project builds no optimizer from that package (its Muon is built in), so code and tests gated on it skip.
HAVE_EMERGING_OPTIMIZERS = False

logger = logging.getLogger(__name__)

__all__ = [
    "AdamOptimizerConfig",
    "ChainedOptimizer",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "Float16OptimizerWithFloat16Params",
    "FP32Optimizer",
    "HybridDeviceOptimizer",
    "LayerWiseDistributedOptimizer",
    "MegatronGradScaler",
    "MegatronModule",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "ParamGroupOverride",
    "ParamKey",
    "ParamPredicate",
    "ParamWithNamePredicate",
    "ProcessGroupCollection",
    "SGDOptimizerConfig",
    "check_config_overrides_consistency",
    "clip_grad_by_total_norm_fp32",
    "combine_param_group_overrides",
    "count_zeros_fp32",
    "get_grad_norm_fp32",
    "get_megatron_optimizer",
    "get_model_config",
    "get_mup_config_overrides",
    "get_pg_rank",
    "get_pg_size",
    "get_standard_config_overrides",
    "is_te_min_version",
    "param_group_identifier_keys",
    "init_optimizer_state",
    "is_managed_by_layer_wise_optimizer",
    "param_group_override_to_tuple",
]


def _is_vector_like(param: torch.nn.Parameter, name: str) -> bool:
    """muP's vector-like parameters: embeddings and 1-D parameters (their learning rate does not shrink with width)."""
    if getattr(param, "shared_embedding", False):
        return True
    is_embedding = getattr(param, "is_embedding_parameter", None)
    if is_embedding is None:
        is_embedding = "embedding" in name.lower()
    return bool(is_embedding) or param.dim() <= 1


def get_mup_config_overrides(
    config: OptimizerConfig, mup_width_mult: float, optimizer_type: str = "adam"
) -> ConfigOverrides:
    """muP's per-parameter learning rates (and Adam epsilons) for a model ``mup_width_mult`` times wider than its
    base: with Adam, hidden (matrix-like) parameters get ``lr / width_mult`` and ``eps / width_mult``; with SGD,
    vector-like parameters get ``lr * width_mult``. Parameters on ``decoupled_lr`` keep it."""
    if mup_width_mult == 1.0:
        return {}
    decoupled = config.decoupled_lr is not None

    def keeps_decoupled_lr(param) -> bool:
        return decoupled and getattr(param, "is_embedding_or_output_parameter", False)

    def scaled_lrs(factor: float) -> ParamGroupOverride:
        override: ParamGroupOverride = {}
        if config.lr is not None:
            override["max_lr"] = config.lr * factor
        if config.min_lr is not None:
            override["min_lr"] = config.min_lr * factor
        return override

    if optimizer_type.lower() == "sgd":
        vector_like = ParamWithNamePredicate(
            name="mup_sgd_vector_like",
            fn=lambda param, name: _is_vector_like(param, name) and not keeps_decoupled_lr(param),
        )
        override = scaled_lrs(mup_width_mult)
        return {ParamKey(with_name_predicate=vector_like): override} if override else {}

    lr_override = scaled_lrs(1.0 / mup_width_mult)
    eps_override: ParamGroupOverride = {}
    if "adam" in optimizer_type.lower():
        eps_override["eps"] = config.adam_eps / mup_width_mult
    hidden = ParamWithNamePredicate(name="mup_hidden", fn=lambda param, name: not _is_vector_like(param, name))
    if not decoupled:
        combined = {**lr_override, **eps_override}
        return {ParamKey(with_name_predicate=hidden): combined} if combined else {}
    overrides: ConfigOverrides = {}
    if lr_override:
        hidden_not_decoupled = ParamWithNamePredicate(
            name="mup_hidden_not_decoupled",
            fn=lambda param, name: not _is_vector_like(param, name) and not keeps_decoupled_lr(param),
        )
        overrides[ParamKey(with_name_predicate=hidden_not_decoupled)] = lr_override
    if eps_override:
        overrides[ParamKey(with_name_predicate=hidden)] = eps_override
    return overrides


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: List[MegatronModule],
    config_overrides: Optional[ConfigOverrides] = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Optional[ProcessGroupCollection] = None,
    dump_param_to_param_group_map: Optional[str] = None,
) -> MegatronOptimizer:
    """Build the optimizer for ``model_chunks`` (DDP-wrapped for data parallelism, or plain modules).

    Returns a :class:`FP32Optimizer` (fp32 model), :class:`Float16OptimizerWithFloat16Params` (bf16/fp16 model) or
    :class:`DistributedOptimizer` (``use_distributed_optimizer``), or a :class:`ChainedOptimizer` of a dense and an
    expert-parallel one when the model has expert parameters. ``config_overrides`` (``{ParamKey:
    ParamGroupOverride}``; None: :func:`get_standard_config_overrides`, ``{}``: no overrides at all) gives the
    parameters each key matches their own schedule values (``max_lr``, ``min_lr``, ``wd_mult``, ``start_wd``,
    ``end_wd``, ``lr_mult``) or torch optimizer settings (e.g. ``eps``). ``use_gloo_process_groups`` is accepted
    for compatibility (no gloo side groups are needed here). ``dump_param_to_param_group_map`` names a directory
    to save ``{parameter name: param-group index}`` to, as a torch.distributed.checkpoint to which every rank
    contributes the parameters it holds (names use global layer numbers; see :func:`_global_param_names`).
    """
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr is None; set the peak learning rate (e.g. lr=3e-4)")
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    if config.optimizer in MUON_OPTIMIZERS:
        return get_megatron_muon_optimizer(
            config,
            model_chunks,
            config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups,
            layer_wise_distributed_optimizer=config.optimizer == "dist_muon"
            or config.use_layer_wise_distributed_optimizer,
            pg_collection=pg_collection,
            dump_param_to_param_group_map=dump_param_to_param_group_map,
        )
    groups = _process_groups(pg_collection)
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    optimizers = _build_optimizers(config, model_chunks, config_overrides, groups, dump_param_to_param_group_map)
    if len(optimizers) == 1:
        return optimizers[0]
    return ChainedOptimizer(optimizers)
