"""DistributedOptimizer: ZeRO-1 sharding of the optimizer over data-parallel ranks (Megatron's distributed optimizer).

DDP (with ``use_distributed_optimizer=True``) lays every bucket out so that each of the d data-parallel ranks owns
an equal contiguous shard of it, and reduce-scatters gradients so that each rank ends up with the summed gradient of
its own shard only. This optimizer keeps, for its shard only, fp32 main parameters (for bf16/fp16 models; an fp32
model's shard is stepped in place) and the torch optimizer's state; after the step it writes the shard back into the
model's parameter buffer, and DDP all-gathers the buffers so every rank has the full updated model.

Bytes per parameter on each rank (bf16 params, fp32 gradient buffer, Adam): 2 (param) + 4 (grad) + 12/d (fp32
main param, exp_avg, exp_avg_sq) = 6 + 12/d, against 18 without sharding.

As in Megatron, ``state_dict()`` holds only what every data-parallel rank shares (the param groups with the step,
and the loss scaler); the parameter state (fp32 main shards, Adam's moments) is saved apart from it, gathered into
data-parallel-independent tensors (``save_parameter_state`` / ``get_parameter_state_dp_zero``) or as sharded state
(``sharded_state_dict``).
"""

from collections import defaultdict
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import (
    common_param_groups,
    extract_common_step,
    get_param_id_to_sharded_param_map,
    is_sharded_state,
    load_torch_optimizer_state,
    make_sharded_optimizer_tensor,
    mark_sharded_state,
    saved_step_and_param_groups,
)
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
from megatron.core.distributed.param_layout import FullParamLayout, compute_full_param_layout
from megatron.core.optimizer import distrib_optimizer_layouts as layouts
from megatron.core.optimizer.distrib_optimizer_layouts import BUCKET_SPACE_LAYOUTS, SHARDING_TYPES, bucket_pieces
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.lion import Lion
from megatron.core.optimizer.optimizer import (
    MixedPrecisionOptimizer,
    _require_keys,
    _zero_grad_group_helper,
    copy_optimizer_param_metadata,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.fsdp_dtensor_checkpoint import flat_piece_entries, global_param_names
from megatron.core.transformer.module import MegatronModule

_FLOAT16_DTYPES = (torch.float16, torch.bfloat16)
# Megatron's name for storing each optimizer-state slice as part of its model parameter's checkpoint entry.
_SHARDING_TYPE = "fully_sharded_model_space"
# Megatron FSDP's layout: per-parameter entries keyed by name (see transformer/fsdp_dtensor_checkpoint.py).
_FSDP_DTENSOR = "fsdp_dtensor"


class Range:
    """A span ``[start, end)`` of a flat buffer or parameter."""

    def __init__(self, start: int, end: int):
        self.start = start
        self.end = end
        self.size = end - start

    def normalize(self, start: int = 0):
        """The span of the same size beginning at ``start`` (e.g. the same elements counted from another origin)."""
        return Range(start, start + self.size)

    def __repr__(self) -> str:
        return f"Range({self.start}, {self.end})"


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
        # Exact: with the distributed optimizer every bucket is padded to a multiple of the DP size.
        shard_size = bucket.grad_data.numel() // world_size
        shard = Range(0, shard_size).normalize(bucket.offset + data_parallel_rank * shard_size)
        for param in bucket.params_list:
            in_buffer = Range(*buffer.param_index_map[param][:2])
            # A parameter may straddle shard boundaries; this rank steps only the piece inside its shard.
            overlap = Range(max(in_buffer.start, shard.start), min(in_buffer.end, shard.end))
            if overlap.size > 0:
                in_param = overlap.normalize(overlap.start - in_buffer.start)
                ranges[param] = ShardRange(overlap.start, overlap.end, in_param.start, in_param.end)
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
        data_parallel_group_gloo: a gloo twin of ``data_parallel_group`` (Megatron gathers legacy checkpoints
            over it); kept, not needed: every collective here runs on ``data_parallel_group``.
        data_parallel_group_idx: this rank's index among the model-parallel ranks (which copy of the data-parallel
            group this is).
        distributed_optimizer_instance_id: which of several distributed-optimizer instances this is (only one
            instance is built: 0).

    ``grad_stats_parallel_group`` (None: every rank, since each data-parallel rank holds a different shard) and
    ``tp_group`` are set by the builder, as for the other optimizers.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: MegatronGradScaler,
        init_state_fn: Optional[Callable],
        model_chunks: List[MegatronModule],
        per_model_buffers: Dict[int, List[_ParamAndGradBuffer]],
        data_parallel_group: torch.distributed.ProcessGroup,
        data_parallel_group_gloo: Optional[torch.distributed.ProcessGroup],
        data_parallel_group_idx: int,
        distributed_optimizer_instance_id: int,
    ):
        if distributed_optimizer_instance_id != 0:
            raise ValueError(
                "DistributedOptimizer: not supported yet: several distributed-optimizer instances "
                f"(distributed_optimizer_instance_id={distributed_optimizer_instance_id})"
            )
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.model_chunks = list(model_chunks)
        self.data_parallel_group = data_parallel_group
        self.data_parallel_group_gloo = data_parallel_group_gloo
        self.data_parallel_group_idx = data_parallel_group_idx
        self.distributed_optimizer_instance_id = distributed_optimizer_instance_id
        self.buffers = [buffer for buffers in per_model_buffers.values() for buffer in buffers]
        dp_size, dp_rank = dist.get_world_size(data_parallel_group), dist.get_rank(data_parallel_group)
        ranges: Dict[torch.nn.Parameter, ShardRange] = {}
        for buffer in self.buffers:
            if not buffer.ddp_config.use_distributed_optimizer:
                raise ValueError(
                    "DistributedOptimizer needs the model wrapped in DistributedDataParallel with "
                    "DistributedDataParallelConfig(use_distributed_optimizer=True)"
                )
            # shard_ranges pairs the buffer's shard size with this group's rank; a mismatch steps pieces twice or never.
            if buffer.data_parallel_world_size != dp_size:
                raise ValueError(
                    f"a DDP buffer is sharded over {buffer.data_parallel_world_size} ranks but the "
                    f"data_parallel_group has {dp_size}; pass the group the DDP wrapper reduces over"
                )
            ranges.update(shard_ranges(buffer, dp_rank))
        # The buffer of each parameter says where its shard lives (FSDP keeps shards apart from the full tensors).
        self._buffer_of = {param: buffer for buffer in self.buffers for param in buffer.param_index_map}
        buffered = self._buffer_of

        self.shard_groups: List[List[_ShardEntry]] = []
        for group in self.optimizer.param_groups:
            entries = []
            for model_param in group["params"]:
                if model_param not in buffered:
                    raise ValueError(
                        f"a parameter of shape {tuple(model_param.shape)} in the optimizer is not in any DDP buffer; "
                        "build the optimizer from the DDP-wrapped model chunks"
                    )
                # A parameter lying wholly in other ranks' shards is stepped by those ranks only.
                if model_param in ranges:
                    shard = ranges[model_param]
                    view = self._model_shard(model_param, shard)
                    entries.append(_make_shard_entry(model_param, shard, view, self._main_params_dtype))
            # From here on the torch optimizer steps the shards, not the model parameters.
            group["params"] = [entry.main_param for entry in entries]
            self.shard_groups.append(entries)
        # Any state the torch optimizer had was keyed by model parameters, which it no longer steps.
        self.optimizer.state = defaultdict(dict)
        self._entry_of = {entry.model_param: entry for entry in self._entries()}
        # What the checkpoint layouts need (Megatron's names): per buffer, this rank's pieces of every bucket's
        # shard, and the buckets' sizes keyed by the buffer's (param dtype, grad dtype).
        self.bucket_pieces = [bucket_pieces(self._entries(), buffer, dp_rank) for buffer in self.buffers]
        self.per_bucket_numel = [
            {(b.param_dtype, b.grad_dtype): [bucket.grad_data.numel() for bucket in b.buckets]} for b in self.buffers
        ]
        self.per_bucket_numel_unpadded = [
            {(b.param_dtype, b.grad_dtype): [bucket.numel_unpadded for bucket in b.buckets]} for b in self.buffers
        ]

    # Megatron's checkpoint layouts of the parameter state (see distrib_optimizer_layouts).
    _get_main_param_and_optimizer_states = layouts._get_main_param_and_optimizer_states
    _set_main_param_and_optimizer_states = layouts._set_main_param_and_optimizer_states
    _state_names = layouts._state_names
    _dp_rank_and_size = layouts._dp_rank_and_size
    _object_key = layouts._object_key
    _gather_buffer = layouts._gather_buffer
    get_parameter_state_dp_reshardable = layouts.get_parameter_state_dp_reshardable
    sharded_param_state_dp_reshardable = layouts.sharded_param_state_dp_reshardable
    load_parameter_state_from_dp_reshardable = layouts.load_parameter_state_from_dp_reshardable
    sharded_param_state_fully_reshardable = layouts.sharded_param_state_fully_reshardable
    load_parameter_state_from_fully_reshardable = layouts.load_parameter_state_from_fully_reshardable
    get_parameter_state_dp_zero = layouts.get_parameter_state_dp_zero
    sharded_param_state_dp_zero = layouts.sharded_param_state_dp_zero
    load_parameter_state_from_dp_zero = layouts.load_parameter_state_from_dp_zero
    save_parameter_state = layouts.save_parameter_state
    load_parameter_state = layouts.load_parameter_state

    @staticmethod
    def compute_full_param_layout(
        params: List[torch.nn.Parameter],
        bucket_size: Optional[int],
        data_parallel_world_size: int,
        ddp_config,
        expert_data_parallel_world_size: Optional[int] = None,
    ) -> "FullParamLayout":
        """Every DDP buffer's layout, with this optimizer's padding rules (see ``distributed/param_layout.py``):
        pass it to DistributedDataParallel as ``full_param_layout``."""
        return compute_full_param_layout(
            params, bucket_size, data_parallel_world_size, ddp_config, expert_data_parallel_world_size
        )

    @property
    def _main_params_dtype(self) -> torch.dtype:
        """What a bf16/fp16 parameter's main shard is stored in (fp32 unless the precision-aware optimizer lowers
        it)."""
        return self.config.main_params_dtype if self.config.use_precision_aware_optimizer else torch.float32

    def state_dtype(self, name: str, buffer: _ParamAndGradBuffer) -> torch.dtype:
        """The storage dtype of one state name of :meth:`_state_names` ("param" or an optimizer state) for the
        parameters of ``buffer`` (one model dtype per buffer), the same on every rank, so that checkpoints hold
        the state as the optimizer keeps it."""
        if name == "param":
            return self._main_params_dtype if buffer.param_dtype in _FLOAT16_DTYPES else torch.float32
        return getattr(self.optimizer, "state_dtypes", {}).get(name, torch.float32)

    def _entries(self):
        return (entry for entries in self.shard_groups for entry in entries)

    def _model_shard(self, model_param, shard: ShardRange) -> torch.Tensor:
        """The model-side storage of ``model_param``'s piece in this rank's shard (its buffer decides where)."""
        return self._buffer_of[model_param].param_shard_view(model_param, shard.param_start, shard.param_end)

    def _grad_shard(self, model_param, shard: ShardRange) -> torch.Tensor:
        return self._buffer_of[model_param].grad_shard_view(model_param, shard.param_start, shard.param_end)

    def owned_main_params(self) -> List[torch.Tensor]:
        return [entry.main_param for entry in self._entries() if entry.owns_main]

    @property
    def optimizer_state_keys(self):
        """Names of the per-parameter optimizer state the torch optimizer keeps (Adam's moments, SGD's momentum,
        Lion's momentum)."""
        # A HybridDeviceOptimizer holds the state of the optimizer class it runs on each side.
        optimizer_class = getattr(self.optimizer, "optimizer_class", type(self.optimizer))
        if issubclass(optimizer_class, torch.optim.SGD):
            return ("momentum_buffer",)
        if issubclass(optimizer_class, Lion):
            return ("exp_avg",)
        return ("exp_avg", "exp_avg_sq")

    def get_grad_stats_parallel_group(self) -> torch.distributed.ProcessGroup:
        """Every data-parallel rank holds a different shard: statistics are summed over the builder's group
        (None: every rank)."""
        return self.grad_stats_parallel_group

    def zero_grad(self, set_to_none: bool = True):
        _zero_grad_group_helper([entry.main_param for entry in self._entries()], set_to_none)
        _zero_grad_group_helper([entry.model_param for entry in self._entries()], set_to_none)
        for entry in self._entries():
            # The precision-aware optimizer's main gradient is a view of DDP's buffer, which DDP zeroes.
            entry.main_param.decoupled_grad = None

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_param, main_param, shard, _ in self._entries():
            # Only this slice of main_grad holds the reduce-scattered sum; the rest of the buffer is unreduced.
            grad = self._grad_shard(model_param, shard)
            if self._use_decoupled_grad:
                # Stored in main_grads_dtype: a view of the buffer when the dtypes agree (no fp32 copy).
                main_dtype = self.config.main_grads_dtype
                main_param.decoupled_grad = grad if grad.dtype == main_dtype else grad.to(main_dtype)
            else:
                # With grad_reduce_in_fp32 this is a view of the buffer; otherwise an fp32 copy.
                main_param.grad = grad if grad.dtype == torch.float32 else grad.float()

    def _copy_main_params_to_model_params(self) -> None:
        for model_param, main_param, shard, owns_main in self._entries():
            # A non-owned main param is a view of the fp32 model parameter, so the step already updated it.
            if owns_main:
                # param.data is a view into the DDP parameter buffer: this writes the shard that the all-gather sends.
                self._model_shard(model_param, shard).copy_(main_param)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step this rank's shard, write it into the model's parameter buffer, and have DDP all-gather the updated
        buffers (at once, or during the next forward with overlap_param_gather)."""
        updated = super().step_with_ready_grads()
        self.prepare_model_params_for_param_sync()
        for chunk in self.model_chunks:
            chunk.mark_params_updated(self.buffers)
        return updated

    def prepare_model_params_for_param_sync(self) -> None:
        """Nothing to prepare before the all-gather: the shard was written into the bf16/fp16/fp32 parameter
        buffer itself (fp8 parameters, which would be re-quantised here, are not built)."""

    def reload_model_params(self, state_dict=None):
        with torch.no_grad():
            for model_param, main_param, shard, owns_main in self._entries():
                # Refresh the fp32 copies from the (e.g. just loaded) model parameters.
                if owns_main:
                    main_param.copy_(self._model_shard(model_param, shard))

    def state_dict(self):
        """Megatron's: the data-parallel-independent state only (see :meth:`_common_state`); the parameter state
        goes through :meth:`save_parameter_state` or :meth:`get_parameter_state_dp_zero`."""
        return self._common_state()

    def load_state_dict(self, state_dict):
        """Load a loaded sharded state (parameter state included), or a :meth:`state_dict`: the param groups'
        hyperparameters, the step and the loss scaler. The parameter state is left as it is, for
        :meth:`load_parameter_state` (or :meth:`load_parameter_state_from_dp_zero`) to fill."""
        if is_sharded_state(state_dict):
            return self._load_sharded_state_dict(state_dict)
        if "param_to_group_meta" in state_dict:
            return self._load_fsdp_dtensor_state(state_dict)
        _require_keys(state_dict, ("optimizer",), type(self).__name__)
        # The state tensors must exist for the torch optimizer to keep them and the parameter state to fill them
        # (init_state_fn leaves existing state alone).
        self.init_state_fn(self.optimizer, self.config)
        self._load_common_state(state_dict)

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Dict[str, Any] = {},  # noqa: B006 - Megatron's signature; never mutated
        is_loading: bool = False,
        sharding_type: Optional[str] = None,
        metadata: Optional[dict] = None,
    ):
        """This rank's optimizer state as pieces of the global checkpoint, in one of Megatron's layouts (see
        ``distrib_optimizer_layouts``): ``metadata['distrib_optim_sharding_type']`` (``sharding_type``, deprecated
        in Megatron, overrides it), by default ``fully_sharded_model_space`` as in Megatron-Core; megatron.training
        asks for ``dp_reshardable`` or, with --dist-ckpt-optim-fully-reshardable, ``fully_reshardable``."""
        sharding_type = sharding_type or (metadata or {}).get("distrib_optim_sharding_type", _SHARDING_TYPE)
        if sharding_type == _FSDP_DTENSOR:
            return self.sharded_param_state_fsdp_dtensor(is_loading)
        if sharding_type not in SHARDING_TYPES:
            raise ValueError(
                f"DistributedOptimizer: sharding_type={sharding_type!r} is not supported; use one of "
                f"{SHARDING_TYPES + (_FSDP_DTENSOR,)}"
            )
        if is_loading:
            # Create the state tensors first so the sharded entries have tensors of the right shapes to load into.
            self.init_state_fn(self.optimizer, self.config)
        common = self._common_state()
        if sharding_type in BUCKET_SPACE_LAYOUTS:
            # As in Megatron, the bucket-space layouts keep the common state per model-parallel group.
            dp_rank = dist.get_rank(self.data_parallel_group)
            replica = (self.distributed_optimizer_instance_id, 0, dp_rank)
            common = {
                name: ShardedObject(self._object_key(name), value, (1,), (0,), replica_id=replica)
                for name, value in common.items()
            }
        build = {
            "dp_reshardable": self.sharded_param_state_dp_reshardable,
            "dp_zero_gather_scatter": self.sharded_param_state_dp_zero,
            "fully_reshardable": self.sharded_param_state_fully_reshardable,
            "fully_sharded_model_space": self.sharded_param_state_fs_model_space,
        }[sharding_type]
        state = {
            **common,
            "param_state": build(model_sharded_state_dict, is_loading, metadata),
            "param_state_sharding_type": sharding_type,
        }
        return mark_sharded_state(state)

    def _common_state(self) -> Dict[str, Any]:
        """What every data-parallel rank shares: the param groups, each with the step (as Megatron stores them),
        and the loss scaler."""
        inner_state = self.optimizer.state_dict()
        step = extract_common_step(inner_state)
        param_groups = common_param_groups(inner_state["param_groups"])
        if step is not None:
            for group in param_groups:
                group["step"] = int(step)
        common = {"optimizer": {"param_groups": param_groups}}
        if self.grad_scaler is not None:
            common["grad_scaler"] = self.grad_scaler.state_dict()
        return common

    def sharded_param_state_fs_model_space(
        self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, metadata: Optional[dict] = None
    ):
        """Megatron's deprecated ``fully_sharded_model_space`` layout: by optimizer parameter index, the fp32 main
        shard and optimizer tensors of each parameter piece, as flat slices (``flattened_range``) of the
        parameter's own checkpoint entry, ``optimizer.state.fp32_param.<key>``, ``optimizer.state.exp_avg.<key>``..."""
        entries = list(self._entries())
        id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, [e.model_param for e in entries])
        param_state = {}
        for index, entry in enumerate(entries):
            if index not in id_to_sharded:
                raise ValueError(
                    f"DistributedOptimizer: a parameter of shape {tuple(entry.model_param.shape)} is not in the "
                    "model's sharded state dict; build it from the same model chunks the optimizer steps"
                )
            model_sharded = id_to_sharded[index]
            tensors = {"fp32_param": entry.main_param, **self.optimizer.state[entry.main_param]}
            # The step is saved once in the common param groups, not per parameter.
            tensors.pop("step", None)
            if is_loading and not entry.owns_main:
                tensors.pop("fp32_param")  # a view of the fp32 model parameter, which the model load fills
            placement = dict(
                flattened_range=slice(entry.shard.param_start, entry.shard.param_end),
                # Each data-parallel rank holds a different slice: all of them are main replicas.
                replica_id=(*model_sharded.replica_id[:2], 0),
            )
            param_state[index] = {
                name: make_sharded_optimizer_tensor(model_sharded, tensor, f"optimizer.state.{name}", **placement)
                for name, tensor in tensors.items()
            }
        return param_state

    @torch.no_grad()
    def load_parameter_state_from_fs_model_space(self, state_dict):
        """Load a loaded ``param_state`` (see :meth:`sharded_param_state_fs_model_space`): the fp32 main shards
        into the main parameters, the optimizer tensors (e.g. Adam's moments) into the torch optimizer's state."""
        for index, entry in enumerate(self._entries()):
            loaded = dict(state_dict[index])
            fp32_param = loaded.pop("fp32_param", None)
            if entry.owns_main:
                entry.main_param.copy_(fp32_param)
            self.optimizer.state[entry.main_param].update(loaded)

    def _fsdp_dtensor_names(self) -> Dict[torch.nn.Parameter, str]:
        """Each parameter's name in the ``fsdp_dtensor`` layout: as the model chunks name it, global layer and
        expert numbers, behind the ``module.`` of Megatron FSDP's wrapper."""
        return {
            param: f"module.{name}" for chunk in self.model_chunks for param, name in global_param_names(chunk).items()
        }

    def _gated(self) -> bool:
        return bool(self.model_chunks) and getattr(self.model_chunks[0].config, "gated_linear_unit", False)

    def fsdp_dtensor_main_params(self):
        """``(model parameter, this rank's main-parameter piece, its first element in the flat parameter)`` for
        every piece this rank steps: the ``fsdp_dtensor`` checkpoint stores these as the model's weights."""
        return [(entry.model_param, entry.main_param, entry.shard.param_start) for entry in self._entries()]

    def sharded_param_state_fsdp_dtensor(self, is_loading: bool = False):
        """Megatron's ``fsdp_dtensor`` layout: ``{"state": {name: {"exp_avg": piece, "exp_avg_sq": piece, "step":
        tensor}}, "param_to_group_meta": {name: the hyperparameters of its group}}`` by parameter name (see
        ``transformer/fsdp_dtensor_checkpoint.py``); a gated MLP's ``linear_fc1`` state is stored as its ``_w`` and
        ``_v`` halves. Loading fills the optimizer's own tensors in place, then :meth:`load_state_dict` takes the
        hyperparameters. The main parameters are the checkpoint's model entries (:meth:`fsdp_dtensor_main_params`)."""
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        names, gated = self._fsdp_dtensor_names(), self._gated()
        state, group_meta = {}, {}
        for group, entries in zip(self.optimizer.param_groups, self.shard_groups):
            hyperparameters = {key: value for key, value in group.items() if key != "params"}
            for entry in entries:
                name, start = names[entry.model_param], entry.shard.param_start
                group_meta[name] = hyperparameters
                values = self.optimizer.state[entry.main_param]
                for key, value in values.items():
                    if key == "step" or not torch.is_tensor(value):
                        continue
                    for part, piece in flat_piece_entries(name, entry.model_param, value, start, gated).items():
                        state.setdefault(part, {})[key] = piece
                        if "step" in values:
                            state[part]["step"] = values["step"]
        result = {"state": state, "param_to_group_meta": group_meta}
        if self.grad_scaler is not None:
            result["grad_scaler"] = self.grad_scaler.state_dict()
        return result

    def _load_fsdp_dtensor_state(self, state_dict: Dict) -> None:
        """After DCP filled the state tensors in place: each group's saved hyperparameters and the loss scaler."""
        names, saved = self._fsdp_dtensor_names(), state_dict["param_to_group_meta"]
        for group, entries in zip(self.optimizer.param_groups, self.shard_groups):
            found = next((saved[names[e.model_param]] for e in entries if names[e.model_param] in saved), {})
            group.update({key: value for key, value in found.items() if key in group and key != "params"})
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _load_sharded_state_dict(self, state_dict: Dict) -> None:
        sharding_type = state_dict.get("param_state_sharding_type", _SHARDING_TYPE)
        load = {
            "dp_reshardable": self.load_parameter_state_from_dp_reshardable,
            "dp_zero_gather_scatter": self.load_parameter_state_from_dp_zero,
            "fully_reshardable": self.load_parameter_state_from_fully_reshardable,
            "fully_sharded_model_space": self.load_parameter_state_from_fs_model_space,
        }.get(sharding_type)
        if load is None:
            raise ValueError(
                f"DistributedOptimizer: the checkpoint's optimizer layout {sharding_type!r} is unknown; "
                f"known layouts: {SHARDING_TYPES}"
            )
        load(state_dict["param_state"])
        self._load_common_state(state_dict)

    def _load_common_state(self, state_dict: Dict) -> None:
        """The saved param groups (matched by Megatron's group key), the step and the loss scaler, keeping the
        current per-parameter state."""
        step, saved_groups = saved_step_and_param_groups(state_dict)
        per_param_state = {
            index: dict(self.optimizer.state[entry.main_param]) for index, entry in enumerate(self._entries())
        }
        load_torch_optimizer_state(self.optimizer, per_param_state, step, saved_groups)
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


def _make_shard_entry(
    model_param: torch.nn.Parameter, shard: ShardRange, model_shard: torch.Tensor, main_dtype: torch.dtype
) -> _ShardEntry:
    if model_param.dtype in _FLOAT16_DTYPES:
        # A master copy of the half-precision shard (fp32 unless the precision-aware optimizer stores it in fp16),
        # so small updates are not lost to rounding.
        main_param, owns_main = model_shard.clone().to(main_dtype), True
    elif model_param.dtype == torch.float32:
        # fp32 needs no master copy: stepping this view updates the model parameter in place.
        main_param, owns_main = model_shard, False
    else:
        raise TypeError(
            f"DistributedOptimizer: parameter of dtype {model_param.dtype} is not supported; "
            "parameters must be float16, bfloat16 or float32"
        )
    copy_optimizer_param_metadata(main_param, model_param)
    return _ShardEntry(model_param, main_param, shard, owns_main)
