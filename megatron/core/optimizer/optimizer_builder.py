"""How get_megatron_optimizer builds its optimizers: parameter groups from config overrides, the torch optimizer,
the Megatron wrapper (FP32, mixed precision or distributed) and the dense/expert split. Muon reuses these with its
own torch optimizer and parameter filter (see muon.py)."""

import re
from typing import Callable, Dict, List, Optional

import functools
import torch
import torch.distributed.checkpoint

from megatron.core.extensions.fused_adam import find_fused_adam
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.core.optimizer.lion import Lion
from megatron.core.optimizer.no_local_params_optimizer import NoLocalParamsOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, MegatronOptimizer
from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdam
from megatron.core.optimizer.optimizer_config import OptimizerConfig, ParamKey, ParamPredicate, ParamWithNamePredicate
from megatron.core.optimizer_param_scheduler import (
    ParamGroupOverride,
    combine_param_group_overrides,
    param_group_override_to_tuple,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.public_api import public_api
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_current_device, get_pg_rank, get_pg_size

ConfigOverrides = Dict[ParamKey, ParamGroupOverride]


@public_api("megatron.core.optimizer")
def get_standard_config_overrides(config: OptimizerConfig) -> ConfigOverrides:
    """Megatron's default grouping: no weight decay on biases and 1-D parameters (with
    ``apply_wd_to_qk_layernorm``, q/k layernorm weights keep theirs), and ``decoupled_lr`` / ``decoupled_min_lr``
    for the input embedding and output layer."""
    if config.apply_wd_to_qk_layernorm:
        no_decay = ParamKey(
            with_name_predicate=ParamWithNamePredicate(
                name="s1_not_qkln",
                fn=lambda param, name: (
                    (len(param.shape) == 1 or name.endswith(".bias"))
                    and not ("q_layernorm." in name or "k_layernorm." in name)
                ),
            )
        )
    else:
        no_decay = ParamKey(name="*.bias", predicate=ParamPredicate(name="param_len_1", fn=lambda p: p.dim() == 1))
    overrides: ConfigOverrides = {no_decay: ParamGroupOverride(wd_mult=0.0)}
    if config.decoupled_lr is not None:
        decoupled: ParamGroupOverride = {"max_lr": config.decoupled_lr}
        if config.decoupled_min_lr is not None:
            decoupled["min_lr"] = config.decoupled_min_lr
        overrides[ParamKey(attr="is_embedding_or_output_parameter")] = decoupled
    return overrides


# Fields one optimizer instance has for all of its parameters: a per-group override cannot change them.
_FIELDS_FIXED_PER_OPTIMIZER = ("overlap_param_gather_with_optimizer_step", "optimizer", "optimizer_cpu_offload")


@public_api("megatron.core.optimizer")
def check_config_overrides_consistency(config: OptimizerConfig, config_overrides: Optional[ConfigOverrides]):
    """Refuse overrides of what a parameter group cannot change on its own (the optimizer and how it runs) and of
    the protected ``params`` key; True otherwise."""
    for key, override in (config_overrides or {}).items():
        if "params" in override:
            raise ValueError(f"config_overrides[{key}] sets 'params', which is protected; remove it")
        for name in _FIELDS_FIXED_PER_OPTIMIZER:
            if name in override and override[name] != getattr(config, name):
                raise ValueError(
                    f"config_overrides[{key}] sets {name}={override[name]!r} but the optimizer has "
                    f"{name}={getattr(config, name)!r}; it cannot be overridden per parameter group"
                )
    return True


def _get_param_groups(
    model_chunks: List[torch.nn.Module],
    config: OptimizerConfig,
    config_overrides: Optional[ConfigOverrides],
    param_filter: Optional[Callable[[torch.nn.Parameter, str], bool]] = None,
) -> List[Dict]:
    """Group trainable parameters by the combined override of every ParamKey they match (and by whether they are
    expert-parallel, and on the decoupled lr); each group carries Megatron's group keys. ``param_filter(param,
    name)`` keeps only the parameters it accepts (Muon steps the matrices, its scalar optimizer the rest)."""
    params_by_key: Dict[tuple, List[torch.nn.Parameter]] = {}
    overrides_by_key: Dict[tuple, ParamGroupOverride] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or (param_filter is not None and not param_filter(param, name)):
                continue
            matched = [override for key, override in (config_overrides or {}).items() if key.matches(param, name)]
            override = combine_param_group_overrides(matched) if matched else {}
            is_expert_parallel = not getattr(param, "allreduce", True)
            # Kept apart so that checkpoints match groups on (wd_mult, lr_mult, expert, decoupled) as before.
            is_decoupled_lr = config.decoupled_lr is not None and getattr(
                param, "is_embedding_or_output_parameter", False
            )
            key = (param_group_override_to_tuple(override), is_expert_parallel, is_decoupled_lr)
            params_by_key.setdefault(key, []).append(param)
            overrides_by_key[key] = override

    groups = []
    # The same order on every rank (groups without overrides first), whichever parameter each rank sees first.
    for key in sorted(params_by_key, key=lambda key: (bool(key[0]), repr(key[0]), key[1], key[2])):
        params = params_by_key[key]
        _, is_expert_parallel, is_decoupled_lr = key
        override = overrides_by_key[key]
        group = {
            "params": params,
            "is_expert_parallel": is_expert_parallel,
            # The group follows the default lr schedule (its lr is the one to log) unless it overrides an lr.
            "default_config": not any("lr" in name for name in override),
            "wd_mult": 1.0,
            "lr_mult": 1.0,
            "is_decoupled_lr": is_decoupled_lr,
            "max_lr": config.lr,
            "min_lr": config.min_lr,
            **override,
        }
        # Usable before a scheduler sets them: the peak lr, and no decay where wd_mult is 0.
        group["lr"] = group["max_lr"] * group["lr_mult"]
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
        groups.append(group)
    return groups


# torch's single-kernel ("fused") Adam/SGD exist for these devices; on CPU fused AdamW is ~6x faster per step than
# the per-tensor loop.
_FUSED_OPTIMIZER_DEVICES = ("cpu", "cuda")


def _build_torch_optimizer(config: OptimizerConfig, param_groups: List[Dict]) -> torch.optim.Optimizer:
    if config.optimizer_cpu_offload:
        return _build_hybrid_device_optimizer(config, param_groups)
    devices = {param.device.type for group in param_groups for param in group["params"]}
    fused = devices <= set(_FUSED_OPTIMIZER_DEVICES) or None
    if config.optimizer == "adam":
        if config.use_precision_aware_optimizer:
            return PrecisionAwareAdam(
                param_groups,
                lr=config.lr,
                weight_decay=config.weight_decay,
                betas=(config.adam_beta1, config.adam_beta2),
                eps=config.adam_eps,
                fused=fused,
                decoupled_weight_decay=config.decoupled_weight_decay,
                exp_avg_dtype=config.exp_avg_dtype,
                exp_avg_sq_dtype=config.exp_avg_sq_dtype,
                use_decoupled_grad=True,
            )
        extension_adam = find_fused_adam() if devices == {"cuda"} else None
        if extension_adam is not None:  # Transformer Engine's or apex's multi-tensor kernel
            return extension_adam(
                param_groups,
                lr=config.lr,
                weight_decay=config.weight_decay,
                betas=(config.adam_beta1, config.adam_beta2),
                eps=config.adam_eps,
                adam_w_mode=config.decoupled_weight_decay,
            )
        adam = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        return adam(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            fused=fused,
        )
    if config.optimizer == "lion":
        return Lion(
            param_groups, lr=config.lr, betas=(config.lion_beta1, config.lion_beta2), weight_decay=config.weight_decay
        )
    return torch.optim.SGD(
        param_groups, lr=config.lr, weight_decay=config.weight_decay, momentum=config.sgd_momentum, fused=fused
    )


def _build_hybrid_device_optimizer(config: OptimizerConfig, param_groups: List[Dict]) -> HybridDeviceOptimizer:
    """torch's optimizer on both sides of the offload (``use_torch_optimizer_for_cpu_offload`` asks Megatron for
    that on the device side too; here it is always so), fused kernels on CPU and CUDA."""
    devices = {param.device.type for group in param_groups for param in group["params"]}
    if config.use_precision_aware_optimizer:
        # The storage dtypes are the class's own settings (a partial), not param-group hyperparameters.
        optimizer_class = functools.partial(
            PrecisionAwareAdam,
            exp_avg_dtype=config.exp_avg_dtype,
            exp_avg_sq_dtype=config.exp_avg_sq_dtype,
            use_decoupled_grad=True,
        )
        hyperparameters = dict(
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            decoupled_weight_decay=config.decoupled_weight_decay,
        )
    elif config.optimizer == "adam":
        optimizer_class = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        hyperparameters = dict(betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    else:
        optimizer_class, hyperparameters = torch.optim.SGD, dict(momentum=config.sgd_momentum)
    return HybridDeviceOptimizer(
        param_groups,
        offload_fraction=config.optimizer_offload_fraction,
        cpu_optimizer_cls=optimizer_class,
        gpu_optimizer_cls=optimizer_class,
        pin_cpu_grads=config.pin_cpu_grads,
        pin_cpu_params=config.pin_cpu_params,
        overlap_cpu_optimizer_d2h_h2d=config.overlap_cpu_optimizer_d2h_h2d,
        lr=config.lr,
        weight_decay=config.weight_decay,
        fused=devices <= set(_FUSED_OPTIMIZER_DEVICES) or None,
        **hyperparameters,
    )


def init_optimizer_state(optimizer: torch.optim.Optimizer, config: Optional[OptimizerConfig] = None) -> None:
    """Create empty (zero) optimizer state for every parameter, as a first step would (e.g. before loading)."""
    if isinstance(optimizer, HybridDeviceOptimizer):
        optimizer.init_state(lambda sub_optimizer: init_optimizer_state(sub_optimizer, config))
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            if isinstance(optimizer, PrecisionAwareAdam):
                optimizer.init_param_state(param, group)
            elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                # Fused kernels keep the step counter on the parameter's device, the others on the host.
                step_device = param.device if group.get("fused") else torch.device("cpu")
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            elif isinstance(optimizer, Lion):
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            elif isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _make_grad_scaler(config: OptimizerConfig) -> Optional[MegatronGradScaler]:
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def _check_models_match_config(config: OptimizerConfig, model_chunks: List[torch.nn.Module]) -> None:
    for index, chunk in enumerate(model_chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if config.use_distributed_optimizer and ddp_config is None:
            raise ValueError(
                f"OptimizerConfig.use_distributed_optimizer=True but model chunk {index} is not wrapped in "
                "DistributedDataParallel; wrap it with DistributedDataParallelConfig(use_distributed_optimizer=True)"
            )
        if ddp_config is not None and ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
            raise ValueError(
                f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} but model chunk "
                f"{index} was wrapped with DistributedDataParallelConfig.use_distributed_optimizer="
                f"{ddp_config.use_distributed_optimizer}; set both the same"
            )


TorchOptimizerBuilder = Callable[[OptimizerConfig, List[Dict], object], torch.optim.Optimizer]


def _build_one(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    param_groups: List[Dict],
    per_model_buffers: Dict[int, list],
    model_parallel_group,
    data_parallel_group,
    tp_group,
    build_torch_optimizer: Optional[TorchOptimizerBuilder] = None,
) -> MegatronOptimizer:
    if build_torch_optimizer is None:
        optimizer = _build_torch_optimizer(config, param_groups)
    else:
        optimizer = build_torch_optimizer(config, param_groups, tp_group)
    if config.use_distributed_optimizer:
        wrapped = DistributedOptimizer(
            optimizer,
            config,
            _make_grad_scaler(config),
            init_optimizer_state,
            model_chunks,
            per_model_buffers,
            data_parallel_group,
            data_parallel_group_gloo=None,
            data_parallel_group_idx=get_pg_rank(model_parallel_group),
            distributed_optimizer_instance_id=0,
        )
        # Each DP rank holds a different shard, so statistics are summed over model- and data-parallel ranks.
        grad_stats_parallel_group = None
    elif config.fp16 or config.bf16:
        wrapped = Float16OptimizerWithFloat16Params(optimizer, config, _make_grad_scaler(config), init_optimizer_state)
        grad_stats_parallel_group = model_parallel_group
    elif config.loss_scale is not None:
        raise ValueError(
            f"OptimizerConfig.loss_scale={config.loss_scale} needs fp16 or bf16 (an fp32 model is not loss-scaled); "
            "unset loss_scale or enable fp16/bf16"
        )
    else:
        wrapped = FP32Optimizer(optimizer, config, init_optimizer_state)
        grad_stats_parallel_group = model_parallel_group
    if _has_fsdp2_params(param_groups):
        # FSDP2 leaves each DP rank a different shard of every gradient: sum statistics over every rank.
        grad_stats_parallel_group = None
    wrapped.grad_stats_parallel_group = grad_stats_parallel_group
    wrapped.tp_group = tp_group
    # The group whose ranks hold the same gradients (the layer-wise distributed optimizer shards over it).
    wrapped.data_parallel_group = data_parallel_group
    return wrapped


def _has_fsdp2_params(param_groups: List[Dict]) -> bool:
    return any(getattr(p, "is_torch_fsdp2_param", False) for group in param_groups for p in group["params"])


def _buffers_of(chunk: torch.nn.Module, attribute: str, config: OptimizerConfig) -> list:
    """A DDP chunk's gradient buffers (only the distributed optimizer needs them)."""
    return getattr(chunk, attribute) if config.use_distributed_optimizer else []


def _global_param_names(model_chunks: List[torch.nn.Module]) -> Dict[torch.nn.Parameter, str]:
    """Each parameter's name in its chunk, with a transformer layer's per-stage index replaced by its global one
    (``layers.<layer_number - 1>``), so that names are the same at every pipeline layout."""
    names = {}
    for chunk in model_chunks:
        names.update({param: name for name, param in chunk.named_parameters()})
        for module_name, module in chunk.named_modules():
            if isinstance(module, TransformerLayer):
                global_name = re.sub(r"layers\.\d+$", f"layers.{module.layer_number - 1}", module_name)
                names.update({param: f"{global_name}.{name}" for name, param in module.named_parameters()})
    return names


def _param_to_param_group_map(model_chunks, param_groups: List[Dict]) -> Dict[str, int]:
    """``{global parameter name: index of its param group}``, dense groups first, then expert groups."""
    names = _global_param_names(model_chunks)
    return {names[param]: index for index, group in enumerate(param_groups) for param in group["params"]}


def _experts_in_model(pp_group, local: bool) -> bool:
    """Whether any pipeline stage holds expert parameters (ranks of one stage agree, so the pipeline group
    decides); one all-reduce on every rank when there are several stages."""
    if pp_group is None or get_pg_size(pp_group) == 1:
        return local
    flag = torch.tensor([1.0 if local else 0.0], device=get_current_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=pp_group)
    return flag.item() > 0


def _process_groups(pg_collection: Optional[ProcessGroupCollection]) -> ProcessGroupCollection:
    return pg_collection or ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "pp", "mp", "dp_cp", "expt_tp", "tp_ep_pp", "expt_dp"]
    )


def _build_optimizers(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    config_overrides: ConfigOverrides,
    groups: ProcessGroupCollection,
    dump_param_to_param_group_map: Optional[str] = None,
    param_filter: Optional[Callable[[torch.nn.Parameter, str], bool]] = None,
    build_torch_optimizer: Optional[TorchOptimizerBuilder] = None,
    require_params: bool = True,
) -> List[MegatronOptimizer]:
    """The dense optimizer and the expert-parallel one (or a placeholder where another stage has experts) for the
    parameters ``param_filter`` accepts; ``build_torch_optimizer(config, param_groups, tp_group)`` replaces
    the Adam/SGD choice (Muon builds its own)."""
    _check_models_match_config(config, model_chunks)
    check_config_overrides_consistency(config, config_overrides)
    param_groups = _get_param_groups(model_chunks, config, config_overrides, param_filter)
    dense_groups = [g for g in param_groups if not g["is_expert_parallel"]]
    expert_groups = [g for g in param_groups if g["is_expert_parallel"]]
    # Taken before the optimizers replace model parameters by their main copies in the groups.
    if dump_param_to_param_group_map is not None:
        param_to_group = _param_to_param_group_map(model_chunks, dense_groups + expert_groups)

    optimizers = []
    if dense_groups:
        buffers = {i: _buffers_of(chunk, "buffers", config) for i, chunk in enumerate(model_chunks)}
        optimizers.append(
            _build_one(
                config, model_chunks, dense_groups, buffers, groups.mp, groups.dp_cp, groups.tp, build_torch_optimizer
            )
        )
    experts_in_model = _experts_in_model(getattr(groups, "pp", None), bool(expert_groups))
    if expert_groups:
        buffers = {i: _buffers_of(chunk, "expert_parallel_buffers", config) for i, chunk in enumerate(model_chunks)}
        optimizers.append(
            _build_one(
                config,
                model_chunks,
                expert_groups,
                buffers,
                groups.tp_ep_pp,
                groups.expt_dp,
                groups.expt_tp,
                build_torch_optimizer,
            )
        )
    elif experts_in_model:
        # A dense stage of an MoE model still joins the expert optimizer's statistics collectives.
        placeholder = NoLocalParamsOptimizer(config, has_grad_scaler=_make_grad_scaler(config) is not None)
        placeholder.grad_stats_parallel_group = None if config.use_distributed_optimizer else groups.tp_ep_pp
        placeholder.tp_group = groups.expt_tp
        placeholder.data_parallel_group = groups.expt_dp
        optimizers.append(placeholder)
    if not optimizers and require_params:
        raise ValueError("get_megatron_optimizer: the model has no trainable parameters (requires_grad=True)")
    if dump_param_to_param_group_map is not None:
        torch.distributed.checkpoint.save(state_dict=param_to_group, checkpoint_id=dump_param_to_param_group_map)
    return optimizers
