"""DistributedOptimizer: ZeRO-1 sharding of the optimizer over data-parallel ranks (Megatron's distributed optimizer).

DDP (with ``use_distributed_optimizer=True``) lays every bucket out so that each of the d data-parallel ranks owns
an equal contiguous shard of it, and reduce-scatters gradients so that each rank ends up with the summed gradient of
its own shard only. This optimizer keeps, for its shard only, fp32 main parameters (for bf16/fp16 models; an fp32
model's shard is stepped in place) and the torch optimizer's state; after the step it writes the shard back into the
model's parameter buffer, and DDP all-gathers the buffers so every rank has the full updated model.

Bytes per parameter on each rank (bf16 params, fp32 gradient buffer, Adam): 2 (param) + 4 (grad) + 12/d (fp32
main param, exp_avg, exp_avg_sq) = 6 + 12/d, against 18 without sharding.

``state_dict()`` holds this rank's shard only: it reloads into the same data-parallel layout.
"""

from collections import defaultdict
from typing import Callable, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import (
    MixedPrecisionOptimizer,
    _require_keys,
    _zero_grad_group_helper,
    copy_param_attributes,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig

_FLOAT16_DTYPES = (torch.float16, torch.bfloat16)


class ShardRange(NamedTuple):
    """The part of one parameter inside this rank's shard: buffer coordinates and flat-parameter coordinates."""

    buffer_start: int
    buffer_end: int
    param_start: int
    param_end: int


def shard_ranges(buffer: _ParamAndGradBuffer, data_parallel_rank: int) -> Dict[torch.nn.Parameter, ShardRange]:
    """For every parameter that overlaps this rank's shard of its bucket, the overlapping range."""
    world_size = buffer.data_parallel_world_size
    ranges = {}
    for bucket in buffer.buckets:
        shard_size = bucket.grad_data.numel() // world_size
        shard_start = bucket.offset + data_parallel_rank * shard_size
        shard_end = shard_start + shard_size
        for param in bucket.params_list:
            param_start, param_end, _ = buffer.param_index_map[param]
            start, end = max(param_start, shard_start), min(param_end, shard_end)
            if start < end:
                ranges[param] = ShardRange(start, end, start - param_start, end - param_start)
    return ranges


class _ShardEntry(NamedTuple):
    model_param: torch.nn.Parameter
    main_param: torch.Tensor
    shard: ShardRange
    owns_main: bool  # False when main_param is a view of an fp32 model parameter


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Steps this data-parallel rank's shard of every DDP buffer (see the module docstring).

    Args:
        optimizer: torch optimizer built over the model parameters; its param groups are re-pointed at the shards.
        config: the OptimizerConfig.
        grad_scaler: loss scaler (fp16), or None.
        init_state_fn: ``fn(torch_optimizer, config)`` creating empty optimizer state.
        model_chunks: the DDP-wrapped model chunks (their parameters are gathered after each step).
        per_model_buffers: ``{chunk index: [buffers]}`` holding every parameter of ``optimizer``.
        data_parallel_group: the group the buffers are sharded over.
        grad_stats_parallel_group: group for gradient norms and overflow checks (None: every rank).
        tp_group: tensor-parallel group, to count replicated parameters once.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Callable,
        model_chunks: List[torch.nn.Module],
        per_model_buffers: Dict[int, List[_ParamAndGradBuffer]],
        data_parallel_group: dist.ProcessGroup,
        grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
    ):
        super().__init__(optimizer, config, grad_scaler, init_state_fn, grad_stats_parallel_group, tp_group)
        self.model_chunks = list(model_chunks)
        self.data_parallel_group = data_parallel_group
        self.buffers = [buffer for buffers in per_model_buffers.values() for buffer in buffers]
        dp_size, dp_rank = dist.get_world_size(data_parallel_group), dist.get_rank(data_parallel_group)
        ranges: Dict[torch.nn.Parameter, ShardRange] = {}
        for buffer in self.buffers:
            if not buffer.ddp_config.use_distributed_optimizer:
                raise ValueError(
                    "DistributedOptimizer needs the model wrapped in DistributedDataParallel with "
                    "DistributedDataParallelConfig(use_distributed_optimizer=True)"
                )
            if buffer.data_parallel_world_size != dp_size:
                raise ValueError(
                    f"a DDP buffer is sharded over {buffer.data_parallel_world_size} ranks but the "
                    f"data_parallel_group has {dp_size}; pass the group the DDP wrapper reduces over"
                )
            ranges.update(shard_ranges(buffer, dp_rank))
        buffered = {param for buffer in self.buffers for param in buffer.param_index_map}

        self.shard_groups: List[List[_ShardEntry]] = []
        for group in self.optimizer.param_groups:
            entries = []
            for model_param in group["params"]:
                if model_param not in buffered:
                    raise ValueError(
                        f"a parameter of shape {tuple(model_param.shape)} in the optimizer is not in any DDP buffer; "
                        "build the optimizer from the DDP-wrapped model chunks"
                    )
                if model_param in ranges:
                    entries.append(_make_shard_entry(model_param, ranges[model_param]))
            group["params"] = [entry.main_param for entry in entries]
            self.shard_groups.append(entries)
        # Any state the torch optimizer had was keyed by model parameters, which it no longer steps.
        self.optimizer.state = defaultdict(dict)

    def _entries(self):
        return (entry for entries in self.shard_groups for entry in entries)

    def owned_main_params(self) -> List[torch.Tensor]:
        return [entry.main_param for entry in self._entries() if entry.owns_main]

    def zero_grad(self, set_to_none: bool = True) -> None:
        _zero_grad_group_helper([entry.main_param for entry in self._entries()], set_to_none)
        _zero_grad_group_helper([entry.model_param for entry in self._entries()], set_to_none)

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_param, main_param, shard, _ in self._entries():
            grad = model_param.main_grad.view(-1)[shard.param_start : shard.param_end]
            main_param.grad = grad if grad.dtype == torch.float32 else grad.float()

    def _copy_main_params_to_model_params(self) -> None:
        for model_param, main_param, shard, owns_main in self._entries():
            if owns_main:
                model_param.detach().view(-1)[shard.param_start : shard.param_end].copy_(main_param)
        for chunk in self.model_chunks:
            chunk.mark_params_updated(self.buffers)

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for model_param, main_param, shard, owns_main in self._entries():
                if owns_main:
                    main_param.copy_(model_param.detach().view(-1)[shard.param_start : shard.param_end])

    def state_dict(self) -> Dict:
        """This rank's shard: the torch optimizer state, the fp32 main shards of bf16/fp16 parameters, the scaler."""
        state = {
            "optimizer": self.optimizer.state_dict(),
            "shard_fp32_from_float16_groups": [
                [entry.main_param.detach() for entry in entries if entry.owns_main] for entries in self.shard_groups
            ],
        }
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict) -> None:
        _require_keys(state_dict, ("optimizer", "shard_fp32_from_float16_groups"), type(self).__name__)
        saved = state_dict["shard_fp32_from_float16_groups"]
        mine = [[entry for entry in entries if entry.owns_main] for entries in self.shard_groups]
        saved_shapes = [[tuple(t.shape) for t in group] for group in saved]
        my_shapes = [[tuple(entry.main_param.shape) for entry in group] for group in mine]
        if saved_shapes != my_shapes:
            raise ValueError(
                "DistributedOptimizer: the saved shards do not match this rank's shards; the checkpoint was "
                "written with a different model, data-parallel size or bucket size"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        with torch.no_grad():
            for group, saved_group in zip(mine, saved):
                for entry, saved_param in zip(group, saved_group):
                    entry.main_param.copy_(saved_param)


def _make_shard_entry(model_param: torch.nn.Parameter, shard: ShardRange) -> _ShardEntry:
    model_shard = model_param.detach().view(-1)[shard.param_start : shard.param_end]
    if model_param.dtype in _FLOAT16_DTYPES:
        main_param, owns_main = model_shard.clone().float(), True
    elif model_param.dtype == torch.float32:
        main_param, owns_main = model_shard, False
    else:
        raise TypeError(
            f"DistributedOptimizer: parameter of dtype {model_param.dtype} is not supported; "
            "parameters must be float16, bfloat16 or float32"
        )
    copy_param_attributes(main_param, model_param)
    return _ShardEntry(model_param, main_param, shard, owns_main)
