"""Validation of TransformerConfig's mixture-of-experts fields, called from ``TransformerConfig.__post_init__``.

One small function per rule; each failure is one ValueError naming the field(s), the value(s) and the fix, raised
while the config is built, before any model or collective exists. Defaults derived here as Megatron derives them:
``moe_ffn_hidden_size`` (= ``ffn_hidden_size``) and the deprecated ``moe_router_topk_limited_devices`` (= group-
limited routing over the expert-parallel ranks).
"""

from __future__ import annotations

from typing import List

_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
_DISPATCHERS = ("allgather", "alltoall", "flex")
_ROUTER_DTYPES = (None, "fp32", "fp64")
_DROP_POLICIES = ("probs", "position")


def validate_moe_config(config) -> None:
    """Check (and complete) every MoE field of ``config``; a dense config only may not set expert parallelism."""
    if config.num_moe_experts is None:
        _validate_dense(config)
        return
    _validate_experts(config)
    _derive_moe_defaults(config)
    _validate_layer_freq(config)
    _validate_router(config)
    _validate_load_balancing(config)
    _validate_group_limited_routing(config)
    _validate_capacity(config)
    _validate_dispatcher(config)
    _validate_parallel_sizes(config)
    _validate_shared_experts(config)


def _validate_dense(config) -> None:
    if config.expert_model_parallel_size > 1:
        raise ValueError(
            f"expert_model_parallel_size={config.expert_model_parallel_size} needs num_moe_experts (a dense model "
            "has no experts to distribute); set num_moe_experts or expert_model_parallel_size=1"
        )
    if config.moe_shared_expert_intermediate_size is not None:
        raise ValueError(
            "moe_shared_expert_intermediate_size is set but num_moe_experts is None; shared experts belong to an "
            "MoE layer: set num_moe_experts or unset moe_shared_expert_intermediate_size"
        )


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _validate_experts(config) -> None:
    _positive_int("num_moe_experts", config.num_moe_experts)
    _positive_int("moe_router_topk", config.moe_router_topk)
    if config.moe_router_topk > config.num_moe_experts:
        raise ValueError(
            f"moe_router_topk={config.moe_router_topk} is larger than num_moe_experts={config.num_moe_experts}; "
            "each token can use at most every expert once: lower moe_router_topk or add experts"
        )
    if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
        raise ValueError(
            f"moe_apply_probs_on_input=True needs moe_router_topk=1 (got {config.moe_router_topk}): with several "
            "experts per token the input cannot carry one probability; unset moe_apply_probs_on_input"
        )


def _derive_moe_defaults(config) -> None:
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    _positive_int("moe_ffn_hidden_size", config.moe_ffn_hidden_size)
    if config.moe_router_topk_limited_devices is not None:
        if config.moe_router_num_groups is not None or config.moe_router_group_topk is not None:
            raise ValueError(
                "moe_router_topk_limited_devices (deprecated) cannot be combined with moe_router_num_groups / "
                "moe_router_group_topk; use only the latter two"
            )
        config.moe_router_num_groups = config.expert_model_parallel_size
        config.moe_router_group_topk = config.moe_router_topk_limited_devices


def _validate_layer_freq(config) -> None:
    freq = config.moe_layer_freq
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        raise ValueError(f"moe_layer_freq must be an int or a list of 0/1 per layer, got {freq!r}")
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1 (every N-th layer is MoE), got {freq}")
        return
    if len(freq) != config.num_layers or any(x not in (0, 1) for x in freq):
        raise ValueError(
            f"moe_layer_freq={freq!r} must list 0 (dense) or 1 (MoE) for each of the num_layers={config.num_layers} "
            "layers"
        )


def _validate_router(config) -> None:
    if config.moe_router_score_function not in _SCORE_FUNCTIONS:
        raise ValueError(
            f"moe_router_score_function={config.moe_router_score_function!r} is not one of {_SCORE_FUNCTIONS}"
        )
    if config.moe_router_dtype not in _ROUTER_DTYPES:
        raise ValueError(f"moe_router_dtype={config.moe_router_dtype!r} must be None, 'fp32' or 'fp64'")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function == "softmax":
        raise ValueError(
            "moe_router_enable_expert_bias=True needs moe_router_score_function='sigmoid' or 'sqrtsoftplus' (the "
            "bias shifts unnormalised scores); change the score function or disable the expert bias"
        )
    for name in ("moe_input_jitter_eps", "moe_router_topk_scaling_factor"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive when set, got {value!r}")
    if config.moe_z_loss_coeff is not None and config.moe_z_loss_coeff < 0:
        raise ValueError(f"moe_z_loss_coeff must be >= 0, got {config.moe_z_loss_coeff}")
    if config.moe_router_bias_update_rate < 0:
        raise ValueError(f"moe_router_bias_update_rate must be >= 0, got {config.moe_router_bias_update_rate}")


def _load_balancing_types(config) -> List[str]:
    kinds = config.moe_router_load_balancing_type
    if isinstance(kinds, str):
        return [kinds]
    if isinstance(kinds, (list, tuple)):
        return list(kinds)
    raise ValueError(f"moe_router_load_balancing_type must be a string or a list of strings, got {kinds!r}")


def _validate_load_balancing(config) -> None:
    kinds = _load_balancing_types(config)
    for kind in kinds:
        if kind == "quantile_balancing":
            raise ValueError(
                "not supported yet: moe_router_load_balancing_type='quantile_balancing'; use one of "
                f"{_LOAD_BALANCING_TYPES}"
            )
        if kind not in _LOAD_BALANCING_TYPES:
            raise ValueError(f"moe_router_load_balancing_type {kind!r} is not one of {_LOAD_BALANCING_TYPES}")
    coeff = config.moe_aux_loss_coeff
    if isinstance(config.moe_router_load_balancing_type, str):
        if isinstance(coeff, (list, tuple)):
            raise ValueError(
                f"moe_aux_loss_coeff={coeff!r} is a list but moe_router_load_balancing_type is one type; give one "
                "coefficient, or a list of types of the same length"
            )
        coeffs = [coeff]
    else:
        if not isinstance(coeff, (list, tuple)) or len(coeff) != len(kinds):
            raise ValueError(
                f"moe_router_load_balancing_type lists {len(kinds)} types {kinds}, so moe_aux_loss_coeff must be a "
                f"list of {len(kinds)} coefficients, got {coeff!r}"
            )
        if "sinkhorn" in kinds or "none" in kinds:
            raise ValueError(f"moe_router_load_balancing_type {kinds}: sinkhorn / none cannot be combined with others")
        coeffs = list(coeff)
    if any(c < 0 for c in coeffs):
        raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {coeff!r}")
    if "sinkhorn" in kinds and coeffs[0] != 0:
        raise ValueError(
            f"moe_router_load_balancing_type='sinkhorn' balances without an aux loss, but moe_aux_loss_coeff={coeff}; "
            "set moe_aux_loss_coeff=0 or use 'aux_loss'"
        )


def _validate_group_limited_routing(config) -> None:
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        raise ValueError(
            f"moe_router_num_groups={groups!r} and moe_router_group_topk={group_topk!r}: group-limited routing "
            "needs both (or neither)"
        )
    _positive_int("moe_router_num_groups", groups)
    _positive_int("moe_router_group_topk", group_topk)
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if experts % groups != 0:
        raise ValueError(f"num_moe_experts={experts} is not divisible by moe_router_num_groups={groups}")
    if group_topk > groups:
        raise ValueError(f"moe_router_group_topk={group_topk} is larger than moe_router_num_groups={groups}")
    if topk % group_topk != 0 or topk // group_topk > experts // groups:
        raise ValueError(
            f"moe_router_topk={topk} must be a multiple of moe_router_group_topk={group_topk} with at most "
            f"{experts // groups} (experts per group) experts taken from each chosen group"
        )


def _validate_capacity(config) -> None:
    factor = config.moe_expert_capacity_factor
    if config.moe_token_drop_policy not in _DROP_POLICIES:
        raise ValueError(f"moe_token_drop_policy={config.moe_token_drop_policy!r} must be 'probs' or 'position'")
    if factor is None:
        if config.moe_pad_expert_input_to_capacity:
            raise ValueError(
                "moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor (without it the MoE is "
                "dropless and has no capacity to pad to); set moe_expert_capacity_factor"
            )
        return
    if not factor > 0:
        raise ValueError(f"moe_expert_capacity_factor must be positive when set, got {factor!r}")
    if config.moe_token_dispatcher_type != "alltoall":
        raise ValueError(
            f"moe_expert_capacity_factor={factor} needs moe_token_dispatcher_type='alltoall' (the "
            f"{config.moe_token_dispatcher_type!r} dispatcher is dropless); switch the dispatcher or unset the "
            "capacity factor"
        )
    kinds = _load_balancing_types(config)
    if not set(kinds) <= {"aux_loss", "seq_aux_loss", "none"}:
        raise ValueError(
            f"moe_expert_capacity_factor works with the aux_loss, seq_aux_loss or none load balancing, not {kinds}"
        )


def _validate_dispatcher(config) -> None:
    kind = config.moe_token_dispatcher_type
    if kind not in _DISPATCHERS:
        raise ValueError(f"moe_token_dispatcher_type={kind!r} is not one of {_DISPATCHERS}")
    if kind == "flex":
        raise ValueError(
            "not supported yet: moe_token_dispatcher_type='flex' (DeepEP / HybridEP kernels); use 'alltoall' or "
            "'allgather'"
        )


def _validate_parallel_sizes(config) -> None:
    ep, experts = config.expert_model_parallel_size, config.num_moe_experts
    if experts % ep != 0:
        raise ValueError(
            f"num_moe_experts={experts} is not divisible by expert_model_parallel_size={ep}; every expert-parallel "
            "rank must hold the same number of experts"
        )
    etp = config.expert_tensor_parallel_size
    if config.moe_ffn_hidden_size % etp != 0:
        raise ValueError(
            f"moe_ffn_hidden_size={config.moe_ffn_hidden_size} is not divisible by expert_tensor_parallel_size={etp}"
        )


def _validate_shared_experts(config) -> None:
    size = config.moe_shared_expert_intermediate_size
    if size is None:
        if config.moe_shared_expert_gate or config.moe_shared_expert_overlap:
            raise ValueError(
                "moe_shared_expert_gate / moe_shared_expert_overlap need moe_shared_expert_intermediate_size"
            )
        return
    _positive_int("moe_shared_expert_intermediate_size", size)
    if size % config.tensor_model_parallel_size != 0:
        raise ValueError(
            f"moe_shared_expert_intermediate_size={size} is not divisible by tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size}"
        )
    if config.moe_shared_expert_overlap and config.moe_token_dispatcher_type != "alltoall":
        raise ValueError(
            "moe_shared_expert_overlap=True overlaps the shared experts with the all-to-all dispatch: it needs "
            f"moe_token_dispatcher_type='alltoall', got {config.moe_token_dispatcher_type!r}"
        )
