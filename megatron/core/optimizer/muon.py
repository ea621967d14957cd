"""Muon (MomentUm Orthogonalized by Newton-Schulz) for Megatron models: TensorParallelMuon steps the 2-D weight
matrices, Adam the rest (embeddings, output layer, biases, norms), chained into one optimizer.

Each step, for a matrix ``W`` with gradient ``G``: decoupled weight decay ``W *= 1 - lr * wd``, an EMA momentum
``M = beta M + (1 - beta) G`` (Nesterov: the update direction is ``G + beta (M - G)``), orthogonalisation of the
direction by Newton-Schulz (see :mod:`muon_utils`), a shape-dependent scale, and ``W -= lr * update``. A fused
``linear_qkv`` weight is orthogonalised as its q, k and v matrices (each collecting its rows of every query group)
unless ``muon_split_qkv`` is off. Under tensor parallelism ``muon_tp_mode`` picks how a split matrix is treated
(see :func:`muon_utils.newton_schulz_tp`); with ``dist_muon`` the whole chain is wrapped in a
:class:`~megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer`.
"""

import dataclasses
import logging
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron.core.optimizer.optimizer_builder import (
    ConfigOverrides,
    _build_optimizers,
    _process_groups,
    get_standard_config_overrides,
)
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron.core.optimizer.muon_utils import (
    get_muon_scale_factor,
    join_qkv_rows,
    newton_schulz_tp,
    split_qkv_rows,
)
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = ["TensorParallelMuon", "get_megatron_muon_optimizer", "init_muon_state"]


class TensorParallelMuon(torch.optim.Optimizer):
    """Muon over parameters that may be tensor-parallel shards (Megatron's class and keyword names).

    ``pg_collection.tp`` (``expt_tp`` for parameters tagged ``expert_tp``) is the group a shard's matrix is split
    over; ``mode`` is 'blockwise', 'duplicated' or 'distributed'. ``is_qkv_fn(param)`` says which parameters are
    fused QKV weights, split by ``qkv_split_shapes`` (rows of q, k, v per query group) when ``split_qkv``.
    """

    def __init__(
        self,
        params,
        lr: float = 3e-4,
        momentum_beta: float = 0.95,
        use_nesterov: bool = True,
        weight_decay: float = 0.01,
        use_decoupled_weight_decay: bool = True,
        split_qkv: bool = False,
        is_qkv_fn: Optional[Callable[[torch.Tensor], bool]] = None,
        qkv_split_shapes: Optional[Sequence[int]] = None,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        pg_collection: Optional[ProcessGroupCollection] = None,
        mode: str = "duplicated",
    ) -> None:
        if num_ns_steps < 1:
            raise ValueError(f"TensorParallelMuon: num_ns_steps must be at least 1, got {num_ns_steps}")
        if split_qkv and qkv_split_shapes is None:
            raise ValueError("TensorParallelMuon: split_qkv=True needs qkv_split_shapes (q, k, v rows per group)")
        defaults = dict(
            lr=lr,
            momentum_beta=momentum_beta,
            use_nesterov=use_nesterov,
            weight_decay=weight_decay,
            use_decoupled_wd=use_decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        self.split_qkv = split_qkv
        self.is_qkv_fn = is_qkv_fn or (lambda param: getattr(param, "is_qkv", False))
        self.qkv_split_shapes = list(qkv_split_shapes) if qkv_split_shapes is not None else None
        # Below 'high', Megatron runs the iteration in bfloat16 (fp32 in and out).
        self.low_precision = fp32_matmul_prec in ("low", "medium")
        self.coefficient_type = coefficient_type
        self.num_ns_steps = num_ns_steps
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        self.pg_collection = pg_collection
        self.mode = mode

    def _tp_group(self, param):
        if self.pg_collection is None:
            return None
        return self.pg_collection.expt_tp if getattr(param, "expert_tp", False) else self.pg_collection.tp

    def _scaled_orthogonal(self, matrix: torch.Tensor, tp_group, partition_dim: Optional[int]) -> torch.Tensor:
        update = newton_schulz_tp(
            matrix,
            self.num_ns_steps,
            self.coefficient_type,
            tp_group,
            partition_dim=partition_dim,
            mode=self.mode,
            low_precision=self.low_precision,
        )
        size = list(matrix.shape)
        if partition_dim is not None and tp_group is not None:
            size[partition_dim] *= torch.distributed.get_world_size(tp_group)
        return update * get_muon_scale_factor(size[0], size[1], self.scale_mode) * self.extra_scale_factor

    def orthogonalize(self, param: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """The scaled, orthogonalised update of ``param`` for the momentum ``direction`` (its shard of it)."""
        tp_group = self._tp_group(param)
        partition_dim = None
        if self.mode != "blockwise" and getattr(param, "tensor_model_parallel", False):
            partition_dim = param.partition_dim
        if self.split_qkv and self.is_qkv_fn(param):
            parts = split_qkv_rows(direction, self.qkv_split_shapes)
            updates = [self._scaled_orthogonal(part, tp_group, partition_dim) for part in parts]
            return join_qkv_rows(updates, self.qkv_split_shapes)
        return self._scaled_orthogonal(direction, tp_group, partition_dim)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, weight_decay, beta = group["lr"], group["weight_decay"], group["momentum_beta"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if weight_decay > 0.0:
                    if group["use_decoupled_wd"]:
                        param.mul_(1.0 - lr * weight_decay)
                    else:
                        grad = grad.add(param, alpha=weight_decay)
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                momentum = state["momentum_buffer"]
                momentum.lerp_(grad, 1.0 - beta)
                direction = grad.lerp(momentum, beta) if group["use_nesterov"] else momentum
                param.add_(self.orthogonalize(param, direction), alpha=-lr)
        return loss


def init_muon_state(optimizer: torch.optim.Optimizer, config: Optional[OptimizerConfig] = None) -> None:
    """Zero momentum for every parameter without state, as a first step would (e.g. before loading)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)


def _qkv_split_shapes(model_chunks) -> Optional[List[int]]:
    """Rows of q, k and v per query group of the model's fused QKV weights (None for a model without attention
    config, e.g. a plain torch module)."""
    chunk, config = model_chunks[0], None
    while config is None and chunk is not None:  # through the wrappers (DDP, Float16Module) to the model
        config, chunk = getattr(chunk, "config", None), getattr(chunk, "module", None)
    heads, groups, channels = (
        getattr(config, name, None) for name in ("num_attention_heads", "num_query_groups", "kv_channels")
    )
    if not heads or not channels:
        return None
    groups = groups or heads
    return [heads // groups * channels, channels, channels]


def _is_muon_param(param: torch.nn.Parameter, name: str) -> bool:
    """Megatron's rule: 2-D weights except the embeddings and the output layer are Muon's."""
    return param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def _tag_params(model_chunks, config: OptimizerConfig, split_shapes: Optional[List[int]]) -> None:
    """Mark expert weights (their TP group is the expert one) and fused QKV weights, and refuse a QKV weight that
    the split cannot divide, before any collective."""
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if ".experts." in f".{name}" and "shared" not in name:
                param.expert_tp = True
            if name.endswith("linear_qkv.weight") and param.dim() == 2:
                param.is_qkv = True
                param.qkv_split_shapes = split_shapes
                if config.muon_split_qkv and (split_shapes is None or param.size(0) % sum(split_shapes)):
                    raise ValueError(
                        f"OptimizerConfig.muon_split_qkv=True cannot split {name} of shape {tuple(param.shape)} into "
                        f"q/k/v rows per query group {split_shapes} (num_attention_heads, num_query_groups and "
                        "kv_channels of the model config); set muon_split_qkv=False to orthogonalise it whole"
                    )


def get_megatron_muon_optimizer(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    config_overrides: Optional[ConfigOverrides] = None,
    use_gloo_process_groups: bool = True,
    layer_wise_distributed_optimizer: bool = False,
    pg_collection: Optional[ProcessGroupCollection] = None,
    dump_param_to_param_group_map: Optional[str] = None,
) -> MegatronOptimizer:
    """Muon for the 2-D weights chained with Adam for the other parameters (each split into a dense and an
    expert-parallel optimizer as :func:`get_megatron_optimizer` does); wrapped in a LayerWiseDistributedOptimizer
    when ``layer_wise_distributed_optimizer``. Called by ``get_megatron_optimizer`` for optimizer 'muon' and
    'dist_muon'; ``use_gloo_process_groups`` is accepted for Megatron's signature (no gloo side groups are needed).
    Refuses, before any collective, a fused QKV weight the q/k/v split cannot divide."""
    if dump_param_to_param_group_map is not None:
        raise ValueError("not supported yet: dump_param_to_param_group_map with the Muon optimizer; leave it None")
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    groups = _process_groups(pg_collection)
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    split_shapes = _qkv_split_shapes(model_chunks)
    _tag_params(model_chunks, config, split_shapes)

    def build_muon(_config: OptimizerConfig, param_groups: List[Dict], _tp_group) -> torch.optim.Optimizer:
        # The TP group is chosen per parameter (dense or expert) from the collection.
        return TensorParallelMuon(
            param_groups,
            lr=config.lr,
            momentum_beta=config.muon_momentum,
            use_nesterov=config.muon_nesterov,
            weight_decay=config.weight_decay,
            use_decoupled_weight_decay=config.decoupled_weight_decay,
            split_qkv=config.muon_split_qkv and split_shapes is not None,
            qkv_split_shapes=split_shapes,
            fp32_matmul_prec=config.muon_fp32_matmul_prec,
            coefficient_type=config.muon_coefficient_type,
            num_ns_steps=config.muon_num_ns_steps,
            scale_mode=config.muon_scale_mode,
            extra_scale_factor=config.muon_extra_scale_factor,
            pg_collection=groups,
            mode=config.muon_tp_mode,
        )

    # The scalar optimizer (muon_scalar_optimizer: Adam or Lion) is built by the plain path, which picks the torch
    # optimizer from config.optimizer.
    step_config = dataclasses.replace(
        config, optimizer=config.muon_scalar_optimizer, use_layer_wise_distributed_optimizer=False
    )
    muon_optimizers = _build_optimizers(
        step_config,
        model_chunks,
        config_overrides,
        groups,
        param_filter=_is_muon_param,
        build_torch_optimizer=build_muon,
        require_params=False,
    )
    for optimizer in muon_optimizers:
        optimizer.init_state_fn = init_muon_state
    scalar_optimizers = _build_optimizers(
        step_config,
        model_chunks,
        config_overrides,
        groups,
        param_filter=lambda param, name: not _is_muon_param(param, name),
        require_params=False,
    )
    optimizers = muon_optimizers + scalar_optimizers
    if not optimizers:
        raise ValueError("get_megatron_optimizer: the model has no trainable parameters (requires_grad=True)")
    # Built with an Adam config (the wrappers pick their path from it); they report the Muon config (checkpoints,
    # the chain's clip and skip settings are the same fields).
    for optimizer in optimizers:
        optimizer.config = config
    if layer_wise_distributed_optimizer:
        return LayerWiseDistributedOptimizer(optimizers, config, groups)
    return ChainedOptimizer(optimizers)
