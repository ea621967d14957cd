"""Megatron's optimizer stack: get_megatron_optimizer builds the right wrapper for a model and an OptimizerConfig.

Parameters are grouped by (weight-decay multiplier, lr multiplier, expert-parallel, decoupled lr): biases and 1-D
parameters (norms) get no weight decay, and with ``decoupled_lr`` the input embedding and output layer get their own
peak/min learning rate. Dense and expert parameters get separate optimizers (their gradients live in different
data-parallel groups), chained when both exist.
"""

import logging
from typing import Callable, Dict, List, Optional

import torch

from megatron.core.extensions.fused_adam import find_fused_adam
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32, get_grad_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = [
    "ChainedOptimizer",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "Float16OptimizerWithFloat16Params",
    "FP32Optimizer",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "get_grad_norm_fp32",
    "get_megatron_optimizer",
    "init_optimizer_state",
]


def _get_param_groups(
    model_chunks: List[torch.nn.Module],
    no_weight_decay_cond: Optional[Callable],
    scale_lr_cond: Optional[Callable],
    lr_mult: float,
    config: OptimizerConfig,
    default_skip_embedding_weight_decay: bool = False,
) -> List[Dict]:
    """Group trainable parameters by how the scheduler treats them (Megatron's grouping and group keys)."""
    params_by_key: Dict[tuple, List[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if no_weight_decay_cond is not None:
                no_wd = no_weight_decay_cond(name, param)
            else:
                no_wd = name.endswith(".bias") or len(param.shape) == 1
                if default_skip_embedding_weight_decay and getattr(param, "is_embedding_or_output_parameter", False):
                    no_wd = True
            scale_lr = scale_lr_cond(name, param) if scale_lr_cond is not None else False
            is_expert_parallel = not getattr(param, "allreduce", True)
            is_decoupled_lr = config.decoupled_lr is not None and getattr(
                param, "is_embedding_or_output_parameter", False
            )
            key = (0.0 if no_wd else 1.0, lr_mult if scale_lr else 1.0, is_expert_parallel, is_decoupled_lr)
            params_by_key.setdefault(key, []).append(param)

    groups = []
    for (wd_mult, group_lr_mult, is_expert_parallel, is_decoupled_lr), params in params_by_key.items():
        if is_decoupled_lr:
            max_lr = config.decoupled_lr
            min_lr = config.decoupled_min_lr if config.decoupled_min_lr is not None else config.min_lr
        else:
            max_lr, min_lr = config.lr, config.min_lr
        groups.append(
            {
                "params": params,
                "wd_mult": wd_mult,
                "lr_mult": group_lr_mult,
                "is_expert_parallel": is_expert_parallel,
                "is_decoupled_lr": is_decoupled_lr,
                "max_lr": max_lr,
                "min_lr": min_lr,
                # Usable before a scheduler sets them: the peak lr, and no decay where wd_mult is 0.
                "lr": max_lr * group_lr_mult,
                "weight_decay": config.weight_decay * wd_mult,
            }
        )
    return groups


# torch's single-kernel ("fused") Adam/SGD exist for these devices; on CPU fused AdamW is ~6x faster per step than
# the per-tensor loop.
_FUSED_OPTIMIZER_DEVICES = ("cpu", "cuda")


def _build_torch_optimizer(config: OptimizerConfig, param_groups: List[Dict]) -> torch.optim.Optimizer:
    devices = {param.device.type for group in param_groups for param in group["params"]}
    fused = devices <= set(_FUSED_OPTIMIZER_DEVICES) or None
    if config.optimizer == "adam":
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
    return torch.optim.SGD(
        param_groups, lr=config.lr, weight_decay=config.weight_decay, momentum=config.sgd_momentum, fused=fused
    )


def init_optimizer_state(optimizer: torch.optim.Optimizer, config: Optional[OptimizerConfig] = None) -> None:
    """Create empty (zero) optimizer state for every parameter, as a first step would (e.g. before loading)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                # Fused kernels keep the step counter on the parameter's device, the others on the host.
                step_device = param.device if group.get("fused") else torch.device("cpu")
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
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


def _build_one(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    param_groups: List[Dict],
    per_model_buffers: Dict[int, list],
    model_parallel_group,
    data_parallel_group,
    tp_group,
) -> MegatronOptimizer:
    optimizer = _build_torch_optimizer(config, param_groups)
    if config.use_distributed_optimizer:
        # Each DP rank holds a different shard, so statistics are summed over model- and data-parallel ranks.
        return DistributedOptimizer(
            optimizer, config, _make_grad_scaler(config), init_optimizer_state, model_chunks, per_model_buffers,
            data_parallel_group, grad_stats_parallel_group=None, tp_group=tp_group,
        )
    if config.fp16 or config.bf16:
        return Float16OptimizerWithFloat16Params(
            optimizer, config, _make_grad_scaler(config), init_optimizer_state, model_parallel_group, tp_group
        )
    if config.loss_scale is not None:
        raise ValueError(
            f"OptimizerConfig.loss_scale={config.loss_scale} needs fp16 or bf16 (an fp32 model is not loss-scaled); "
            "unset loss_scale or enable fp16/bf16"
        )
    return FP32Optimizer(optimizer, config, init_optimizer_state, model_parallel_group, tp_group)


def _buffers_of(chunk: torch.nn.Module, attribute: str, config: OptimizerConfig) -> list:
    """A DDP chunk's gradient buffers (only the distributed optimizer needs them)."""
    return getattr(chunk, attribute) if config.use_distributed_optimizer else []


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    no_weight_decay_cond: Optional[Callable] = None,
    scale_lr_cond: Optional[Callable] = None,
    lr_mult: float = 1.0,
    use_gloo_process_groups: bool = True,
    default_skip_embedding_weight_decay: bool = False,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> MegatronOptimizer:
    """Build the optimizer for ``model_chunks`` (DDP-wrapped for data parallelism, or plain modules).

    Returns a :class:`FP32Optimizer` (fp32 model), :class:`Float16OptimizerWithFloat16Params` (bf16/fp16 model) or
    :class:`DistributedOptimizer` (``use_distributed_optimizer``), or a :class:`ChainedOptimizer` of a dense and an
    expert-parallel one when the model has expert parameters. ``no_weight_decay_cond(name, param)`` and
    ``scale_lr_cond(name, param)`` override the default grouping; ``lr_mult`` is the lr multiplier of
    ``scale_lr_cond`` parameters. ``use_gloo_process_groups`` is accepted for compatibility (no gloo side groups are
    needed here).
    """
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr is None; set the peak learning rate (e.g. lr=3e-4)")
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    _check_models_match_config(config, model_chunks)
    groups = pg_collection or ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "mp", "dp_cp", "expt_tp", "tp_ep_pp", "expt_dp"]
    )
    param_groups = _get_param_groups(
        model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult, config, default_skip_embedding_weight_decay
    )
    dense_groups = [g for g in param_groups if not g["is_expert_parallel"]]
    expert_groups = [g for g in param_groups if g["is_expert_parallel"]]

    optimizers = []
    if dense_groups:
        buffers = {i: _buffers_of(chunk, "buffers", config) for i, chunk in enumerate(model_chunks)}
        optimizers.append(
            _build_one(config, model_chunks, dense_groups, buffers, groups.mp, groups.dp_cp, groups.tp)
        )
    if expert_groups:
        buffers = {i: _buffers_of(chunk, "expert_parallel_buffers", config) for i, chunk in enumerate(model_chunks)}
        optimizers.append(
            _build_one(config, model_chunks, expert_groups, buffers, groups.tp_ep_pp, groups.expt_dp, groups.expt_tp)
        )
    if not optimizers:
        raise ValueError("get_megatron_optimizer: the model has no trainable parameters (requires_grad=True)")
    if len(optimizers) == 1:
        return optimizers[0]
    return ChainedOptimizer(optimizers)
