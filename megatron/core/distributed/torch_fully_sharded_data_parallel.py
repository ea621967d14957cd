"""TorchFullyShardedDataParallel: fully sharded data parallelism through PyTorch's FSDP2 (``fully_shard``).

Each transformer layer (and the embedding) becomes one FSDP2 unit, then the whole model: every parameter turns into a
DTensor sharded along its first axis over the data-parallel(+context-parallel) group, its full value is all-gathered
just before the unit's forward (and again for backward when ``reshard_after_forward``), and gradients are
reduce-scattered so each rank keeps only its shard's gradient in ``param.grad``. The optimizer then steps only these
shards. Tensor parallelism composes as in Megatron-Core: a TP rank's weight is already its TP piece, and FSDP2 shards
that piece over the DP ranks of its own TP coordinate, so the DP x TP grid of a weight is a 1-D DP mesh per TP rank.

The wrapper offers DDP's step API (``zero_grad_buffer``, ``no_sync``, ``finish_grad_sync``, ``scale_gradients``) so
that ``get_megatron_optimizer``, ``finalize_model_grads`` and the pipeline schedules drive it unchanged, and its
``sharded_state_dict`` has the same keys and global shapes as the unwrapped model's, so checkpoints move between
FSDP2 and DDP at any data-parallel size.
"""

from contextlib import contextmanager
from dataclasses import replace
from typing import Optional, Set

import torch
import torch.distributed as dist
from torch.distributed import DeviceMesh, ProcessGroup
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import as_dtensor_like, get_current_device, get_full_tensor_if_necessary, to_local_if_dtensor

# The embeddings live on a floor above this package (megatron.core.models), so they are recognised by class name.
_DEFAULT_UNIT_CLASS_NAMES = ("LanguageModelEmbedding", "RotaryEmbedding")


class TorchFullyShardedDataParallel(MegatronModule):
    """Wrap ``module`` with torch FSDP2 (see the module docstring).

    Args:
        config: the model's TransformerConfig (``calculate_per_token_loss`` decides whether gradients are averaged
            over the data-parallel ranks or summed and divided by the token count later).
        ddp_config: a TorchFullyShardedDataParallelConfig (``reshard_after_forward``); a plain
            DistributedDataParallelConfig means ``reshard_after_forward=True``.
        module: the model chunk to shard.
        sub_modules_to_wrap: the classes whose instances become FSDP2 units; default every TransformerLayer and the
            language-model embedding. Modules may name further units in a ``_fsdp_modules`` list, as in Megatron.
        disable_bucketing: unused (FSDP2 communicates per unit); kept for DDP's signature.
        process_group: the group to shard over; default ``pg_collection.dp_cp`` or parallel_state's DP x CP group.
        pg_collection: explicit groups (its ``dp_cp`` is used when ``process_group`` is not given).
    """

    # megatron.core.utils.unwrap_model strips classes that carry this marker.
    _megatron_model_wrapper = True

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        sub_modules_to_wrap: Optional[Set[type]] = None,
        disable_bucketing: bool = False,
        process_group: Optional[ProcessGroup] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        _check_model_can_be_sharded(config, ddp_config, module)
        super().__init__(config)
        self.module = module
        self.ddp_config = ddp_config
        self.iteration = 0
        """Counts zero_grad_buffer calls (one per training step), as DDP does."""
        if process_group is None:
            if pg_collection is None:
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["dp_cp"])
            process_group = pg_collection.dp_cp
        self.process_group = process_group
        self.dp_cp_group = process_group
        # DTensor caches layouts by mesh, and meshes compare equal by ranks alone: the group's name in the mesh's
        # name keeps a mesh over a re-created group (after destroy/initialize_model_parallel) from resolving to
        # the old, destroyed group.
        self.device_mesh = DeviceMesh.from_group(
            process_group, get_current_device().type, mesh_dim_names=(f"dp_cp_{process_group.group_name}",)
        )
        self._broadcast_full_params()
        saved_attributes = {name: dict(vars(param)) for name, param in module.named_parameters()}
        reshard = getattr(ddp_config, "reshard_after_forward", True)
        previous = None
        for unit in self._units(sub_modules_to_wrap):
            fully_shard(unit, mesh=self.device_mesh, reshard_after_forward=reshard)
            if getattr(config, "recompute_granularity", None) is not None:
                # Recomputed forwards during backward would confuse FSDP2's inferred prefetch order: during a unit's
                # backward, prefetch the unit before it (as Megatron-Core does).
                unit.set_modules_to_backward_prefetch([previous] if previous is not None else [])
            previous = unit
        fully_shard(module, mesh=self.device_mesh, reshard_after_forward=reshard)
        # fully_shard replaces every parameter by a new DTensor Parameter: Megatron's attributes (tensor_model_parallel,
        # sequence_parallel, allreduce, shared, ...) are carried over, and the parameter is marked as FSDP2's.
        for name, param in module.named_parameters():
            for attribute, value in saved_attributes.get(name, {}).items():
                setattr(param, attribute, value)
            param.is_torch_fsdp2_param = True
        if getattr(config, "calculate_per_token_loss", False):
            # Gradients are summed here; finalize_model_grads divides them by the global token count. A plain SUM
            # (not a pre-multiplied one, which gloo lacks) for every unit.
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_gradient_divide_factor(1.0)
                    unit.set_force_sum_reduction_for_comms(True)

    def _units(self, sub_modules_to_wrap: Optional[Set[type]]):
        """The submodules that become FSDP2 units (a unit nested in another keeps its own parameters: fully_shard
        leaves those already managed to the inner unit)."""
        classes = tuple(sub_modules_to_wrap) if sub_modules_to_wrap is not None else (TransformerLayer,)
        extra = {id(m) for sub in self.module.modules() for m in getattr(sub, "_fsdp_modules", [])}
        units = []
        for sub in self.module.modules():
            if sub is self.module or not any(True for _ in sub.parameters()):
                continue
            default_named = sub_modules_to_wrap is None and type(sub).__name__ in _DEFAULT_UNIT_CLASS_NAMES
            if isinstance(sub, classes) or default_named or id(sub) in extra:
                units.append(sub)
        return units

    def _broadcast_full_params(self) -> None:
        """Make every DP rank's full parameters data-parallel rank 0's before sharding, so the shards tile one
        model (DDP broadcasts after wrapping; here the full parameters no longer exist afterwards)."""
        source = dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for param in self.module.parameters():
                dist.broadcast(param.data, src=source, group=self.process_group)

    # ---- the step API DDP offers -------------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients without reduce-scattering them (every micro-batch but the last)."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def start_grad_sync(self, *unused) -> None:
        """Nothing to launch: FSDP2 reduce-scatters each unit's gradients during backward."""

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Nothing to wait for: FSDP2's root waits for its reduce-scatters at the end of backward. Gradients stay
        sharded whatever ``force_all_reduce`` says (each rank steps only its shard)."""

    def scale_gradients(self, scaling_factor) -> None:
        """Multiply this rank's gradient shards by ``scaling_factor``."""
        with torch.no_grad():
            for param in self.module.parameters():
                if param.grad is not None:
                    to_local_if_dtensor(param.grad).mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Drop the gradient shards (FSDP2 keeps no separate buffer): call at the start of each step."""
        self.iteration += 1
        for param in self.module.parameters():
            param.grad = None

    def broadcast_params(self) -> None:
        """Nothing to do: the parameters were made equal across DP ranks before they were sharded."""

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Nothing to gather between steps: FSDP2 gathers each unit's parameters when its forward needs them."""

    # ---- state ---------------------------------------------------------------------------------------------------

    def state_dict(self, prefix: str = "", keep_vars: bool = False, **kwargs):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars, **kwargs)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, *args, **kwargs):
        """The unwrapped model's sharded state dict (same keys and global shapes) holding this rank's shards.

        A weight whose first axis the DP ranks split evenly is stored as this rank's piece, placed inside its
        tensor-parallel piece; every DP rank saves its own. Others (uneven splits, fused tensors stored in parts
        such as SwiGLU's fc1) are gathered whole when the checkpoint is written and stored as without FSDP2.
        """
        sharded = self.module.sharded_state_dict(*args, **kwargs)
        dp_rank, dp_size = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        with torch.no_grad():
            dict_list_map_inplace(lambda entry: _local_shard_entry(entry, dp_rank, dp_size), sharded)
        return sharded

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a state dict holding, for each sharded parameter, this rank's shard (as ``sharded_state_dict``
        stores it) or the whole tensor; either becomes the parameter's DTensor shard."""
        # The module's own state-dict names (a Float16Module wrapper does not add its "module." prefix there).
        current = self.module.state_dict(keep_vars=True)
        converted = {
            name: as_dtensor_like(value, current[name]) if name in current and torch.is_tensor(value) else value
            for name, value in state_dict.items()
        }
        return self.module.load_state_dict(converted, strict=strict)


def _check_model_can_be_sharded(config, ddp_config, module: torch.nn.Module) -> None:
    """Refuse what FSDP2 cannot shard here, before any collective."""
    if getattr(ddp_config, "use_distributed_optimizer", False):
        raise ValueError(
            "TorchFullyShardedDataParallel: use_distributed_optimizer=True cannot be combined with torch FSDP2, "
            "which already shards the optimizer state; leave it False"
        )
    if getattr(config, "fp16", False):
        raise ValueError(
            "TorchFullyShardedDataParallel: fp16 is not supported with torch FSDP2 (as in Megatron-LM); use bf16"
        )
    tied = [
        name
        for name, sub in module.named_modules()
        if getattr(sub, "share_embeddings_and_output_weights", False) and getattr(sub, "post_process", True)
    ]
    if tied:
        owner = tied[0] or "the model"
        raise ValueError(
            f"TorchFullyShardedDataParallel: the model ties its embedding and output weights ({owner} has "
            "share_embeddings_and_output_weights=True), which FSDP2 cannot shard as one parameter in two units; "
            "build it with share_embeddings_and_output_weights=False (--untie-embeddings-and-output-weights)"
        )


def _local_shard_entry(entry, dp_rank: int, dp_size: int):
    """One entry of the model's sharded state dict, rewritten for FSDP2 shards (see sharded_state_dict)."""
    if isinstance(entry, ShardedTensorFactory) and _is_fsdp2_param(entry.data):
        build = entry.build_fn
        return replace(entry, build_fn=lambda key, data, replica_id, fr: build(key, _full(data), replica_id, fr))
    if not isinstance(entry, ShardedTensor) or not _is_fsdp2_param(entry.data):
        return entry
    param = entry.data
    axis = entry.prepend_axis_num
    evenly_split = (
        param.shape[0] % dp_size == 0
        and tuple(entry.local_shape) == tuple(param.shape)
        and entry.flattened_range is None
        and isinstance(entry.replica_id, tuple)
    )
    if not evenly_split:
        return ShardedTensorFactory(
            entry.key,
            param,
            lambda key, data, replica_id, fr: {"whole": replace(entry, data=_full(data), replica_id=replica_id)},
            lambda loaded: loaded["whole"],
            entry.replica_id,
        )
    local = to_local_if_dtensor(param)
    offset = list(entry.global_offset)
    offset[axis] += dp_rank * local.shape[0]
    fragmentations = entry.axis_fragmentations
    if fragmentations is not None:
        fragmentations = tuple(f * dp_size if i == axis else f for i, f in enumerate(fragmentations))
    sharded = replace(
        entry,
        data=local,
        local_shape=tuple(local.shape),
        global_offset=tuple(offset),
        axis_fragmentations=fragmentations,
        # Each DP rank holds a different piece, so each is its piece's main replica.
        replica_id=(*entry.replica_id[:-1], 0),
    )
    # The optimizer finds a parameter's sharded tensor by the parameter (see get_param_id_to_sharded_param_map).
    sharded.is_torch_fsdp2_param = True
    sharded.fsdp2_param = param
    return sharded


def _is_fsdp2_param(tensor) -> bool:
    return isinstance(tensor, DTensor) and getattr(tensor, "is_torch_fsdp2_param", False)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return get_full_tensor_if_necessary(tensor)
