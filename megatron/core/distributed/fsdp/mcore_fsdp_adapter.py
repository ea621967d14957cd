"""``FullyShardedDataParallel``: Megatron FSDP's model wrapper (``megatron.core.distributed.fsdp``).

It wraps a model chunk the way :class:`DistributedDataParallel` does (same buffers, bucket groups, hooks and step
API), so ``get_megatron_optimizer`` (the distributed optimizer steps each rank's shard) and
``finalize_model_grads`` work unchanged. Parameters are grouped into FSDP units: each module of a class in
``fsdp_unit_modules`` (by default every ``TransformerLayer``) is one unit; every other parameter (embeddings, final
norm, output layer) is a unit of its own, so tied weights have the same layout on every pipeline stage. Each unit
has its own buffers (one per dtype pair, dense and expert apart), and
``ddp_config.data_parallel_sharding_strategy`` decides what each rank keeps between steps:

- ``no_shard``: parameters, gradients and optimizer state whole (DDP);
- ``optim``: optimizer state 1/DP (ZeRO-1, the distributed optimizer);
- ``optim_grads``: gradients too (ZeRO-2);
- ``optim_grads_params``: parameters too (ZeRO-3).

With ``optim_grads_params`` a unit's parameters are all-gathered by a forward pre-hook and freed by the forward
post-hook, gathered again when the gradient of the unit's output arrives (before its backward) and freed once its
gradients are reduce-scattered; with ``overlap_param_gather`` the next unit's gather is started asynchronously
before the current unit runs. Parameters outside units are gathered at the start of ``forward`` and freed after
their backward. See ``sharded_buffer.py`` for the memory itself.
"""

from typing import List, Optional

import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.sharded_buffer import ShardedBucketGroup, ShardedParamAndGradBuffer
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer, group_params_for_buffers
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import warn_once

_SHARDED_GRADS = ("optim_grads", "optim_grads_params")

# Megatron FSDP's double buffer is an allocator policy: the gathered parameters of identical units go into one of two
# persistent, fixed-address buffers, so the CUDA caching allocator does not fragment and NCCL can register them
# (--nccl-ub). Here a unit's gathered parameters live in the unit's own storage, grown for the gather and shrunk to
# zero after it, which keeps the parameters' views and autograd's saved tensors attached to it; at most the running
# unit and the one prefetched are gathered at a time, the peak two buffers would give. Fixed addresses would matter
# only to the CUDA allocator and NCCL registration, which the gloo/CPU path does not have: the flag is accepted (launch
# scripts set it) and changes nothing, and says so.
_DOUBLE_BUFFER_NOTICE = (
    "fsdp_double_buffer=True (--fsdp-double-buffer) has no effect here: each FSDP unit gathers into its own storage, "
    "freed after use, and at most two units are gathered at a time already; Megatron's fixed pool of two buffers "
    "serves the CUDA allocator and NCCL user-buffer registration, which this implementation does not use"
)


class FullyShardedDataParallel(DistributedDataParallel):
    """Wrap ``module`` for Megatron FSDP (see the module docstring).

    Args:
        config: the model's TransformerConfig.
        ddp_config: with ``use_megatron_fsdp=True`` and the ``data_parallel_sharding_strategy``.
        module: the model chunk.
        fsdp_unit_modules: module classes whose instances are FSDP units (default ``[TransformerLayer]``).
        disable_bucketing: as for DistributedDataParallel (FSDP buckets are its units already).
        device: accepted for Megatron's signature; parameters stay where the module has them.
        pg_collection: explicit groups (``dp_cp`` and ``expt_dp``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        fsdp_unit_modules: Optional[List[type]] = None,
        disable_bucketing: bool = False,
        device: Optional[torch.device] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        _check_config(ddp_config)
        if ddp_config.fsdp_double_buffer:
            warn_once(_DOUBLE_BUFFER_NOTICE)
        del device
        strategy = ddp_config.data_parallel_sharding_strategy
        self.data_parallel_sharding_strategy = strategy
        self._shard_grads = strategy in _SHARDED_GRADS
        self._shard_params = strategy == "optim_grads_params"
        self._unit_classes = tuple(fsdp_unit_modules or (TransformerLayer,))
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing, pg_collection=pg_collection)
        self._unit_buffers = self._buffers_by_unit()
        self._fsdp_hooks = []
        if self._shard_grads:
            self._register_unit_hooks()

    # ---- construction ----------------------------------------------------------------------------------------

    def _unit_modules(self) -> List[torch.nn.Module]:
        return [m for m in self.module.modules() if isinstance(m, self._unit_classes)]

    def _split_by_unit(self, params: List[torch.nn.Parameter]) -> List[List[torch.nn.Parameter]]:
        """``params`` grouped per unit module, then one group per remaining parameter (in registration order)."""
        wanted = set(params)
        groups, placed = [], set()
        for unit in self._unit_modules():
            members = [p for p in unit.parameters() if p in wanted and p not in placed]
            placed.update(members)
            if members:
                groups.append(members)
        groups.extend([p] for p in params if p not in placed)
        return groups

    def _allocate_buffers(self, params: List[torch.nn.Parameter], group, scaling_factor: float):
        """One buffer (one bucket) per unit and dtype pair, laid out for the distributed optimizer."""
        grad_dtype = self.ddp_config.megatron_fsdp_main_grads_dtype
        buffers = []
        for unit_params in self._split_by_unit(params):
            for key, (dtype_params, _) in group_params_for_buffers(
                unit_params, self.ddp_config.grad_reduce_in_fp32
            ).items():
                args = (self.ddp_config, key.param_dtype, grad_dtype or key.grad_dtype, dtype_params, group, None)
                rest = (self.param_to_name, scaling_factor)
                if self._shard_grads:
                    buffer = ShardedParamAndGradBuffer(
                        *args,
                        *rest,
                        shard_params=self._shard_params,
                        grad_comm_dtype=self.ddp_config.megatron_fsdp_grad_comm_dtype,
                    )
                else:
                    buffer = _ParamAndGradBuffer(*args, *rest)
                buffers.append(buffer)
        return buffers

    def _partition_buckets(self, buffers, disable_bucketing: bool):
        if self._shard_grads:
            return [ShardedBucketGroup(buffer) for buffer in buffers]
        return super()._partition_buckets(buffers, disable_bucketing)

    def _buffers_by_unit(self):
        """``{unit module: its sharded buffers}`` and, under None, the buffers of parameters outside units."""
        owner = {}
        for buffer in self.buffers + self.expert_parallel_buffers:
            for param in buffer.params:
                owner[param] = buffer
        by_unit = {None: []}
        units = self._unit_modules()
        in_unit = set()
        for unit in units:
            found = []
            for param in unit.parameters():
                if param in owner and owner[param] not in found:
                    found.append(owner[param])
            by_unit[unit] = found
            in_unit.update(found)
        by_unit[None] = [b for b in self.buffers + self.expert_parallel_buffers if b not in in_unit]
        self._unit_order = units
        return by_unit

    # ---- per-unit hooks (optim_grads, optim_grads_params) ----------------------------------------------------

    def _register_unit_hooks(self) -> None:
        for index, unit in enumerate(self._unit_order):
            self._fsdp_hooks.append(unit.register_forward_pre_hook(self._make_pre_forward(index)))
            self._fsdp_hooks.append(unit.register_forward_hook(self._make_post_forward(index)))

    def _allocate_grads(self, unit: Optional[torch.nn.Module]) -> None:
        for buffer in self._unit_buffers[unit]:
            buffer.allocate_grads()

    def _gather(self, index: Optional[int], prefetch: Optional[int] = None) -> None:
        """Gather unit ``index`` (None: the parameters outside units) and wait; start ``prefetch``'s gather."""
        unit = None if index is None else self._unit_order[index]
        for buffer in self._unit_buffers[unit]:
            buffer.gather_params()
        if prefetch is not None and self.ddp_config.overlap_param_gather and 0 <= prefetch < len(self._unit_order):
            for buffer in self._unit_buffers[self._unit_order[prefetch]]:
                buffer.gather_params(async_op=True)
        for buffer in self._unit_buffers[unit]:
            buffer.wait_params()

    def _release(self, index: int) -> None:
        for buffer in self._unit_buffers[self._unit_order[index]]:
            buffer.release_params()

    def _make_pre_forward(self, index: int):
        def pre_forward(module, args):
            self._gather(index, prefetch=index + 1)

        return pre_forward

    def _make_post_forward(self, index: int):
        def post_forward(module, args, output):
            self._release(index)
            if torch.is_grad_enabled():
                outputs = output if isinstance(output, (tuple, list)) else (output,)
                for tensor in outputs:
                    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                        # Runs when this unit's output gradient is ready, i.e. just before the unit's backward.
                        tensor.register_hook(self._make_pre_backward(index))
            return output

        return post_forward

    def _make_pre_backward(self, index: int):
        def pre_backward(grad):
            self._gather(index, prefetch=index - 1)
            # Before any gradient of the unit lands in main_grad (gradient-accumulation fusion writes it from
            # inside the layer's backward): the full, zeroed gradient tensors.
            self._allocate_grads(self._unit_order[index])
            return grad

        return pre_backward

    def gather_all_params(self) -> None:
        """All-gather every unit's full parameters (checkpointing reads and writes the full tensors)."""
        for buffer in self.buffers + self.expert_parallel_buffers:
            if isinstance(buffer, ShardedParamAndGradBuffer):
                buffer.gather_params()
                buffer.wait_params()

    def release_all_params(self) -> None:
        for buffer in self.buffers + self.expert_parallel_buffers:
            if isinstance(buffer, ShardedParamAndGradBuffer):
                buffer.release_params()

    # ---- the step API ----------------------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        if self._shard_params:
            self._gather(None)
        if self._shard_grads and torch.is_grad_enabled():
            self._allocate_grads(None)
        return self.module(*inputs, **kwargs)

    def _accumulate_into_main_grad(self, param: torch.nn.Parameter) -> None:
        if self._shard_grads:
            self.param_to_bucket_group[param].buffer.allocate_grads()
        super()._accumulate_into_main_grad(param)

    def broadcast_params(self) -> None:
        """Copy data-parallel rank 0's parameters to every DP rank (the full parameters, then the shards)."""
        self.gather_all_params()
        super().broadcast_params()
        for buffer in self.buffers + self.expert_parallel_buffers:
            if isinstance(buffer, ShardedParamAndGradBuffer):
                buffer.copy_shard_from_full()

    # ---- state: the wrapped module's, with full parameters -----------------------------------------------------

    def state_dict(self, prefix: str = "", keep_vars: bool = False, **kwargs):
        self.gather_all_params()
        return super().state_dict(prefix=prefix, keep_vars=keep_vars, **kwargs)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        self.gather_all_params()
        return super().state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, *args, **kwargs):
        """The wrapped model's sharded state dict (the same keys as without FSDP), over gathered parameters."""
        self.gather_all_params()
        return super().sharded_state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the full parameters, then take each rank's shards from them."""
        self.gather_all_params()
        result = super().load_state_dict(state_dict, strict=strict)
        for buffer in self.buffers + self.expert_parallel_buffers:
            if isinstance(buffer, ShardedParamAndGradBuffer):
                buffer.copy_shard_from_full()
        return result


def _check_config(ddp_config: DistributedDataParallelConfig) -> None:
    if not ddp_config.use_megatron_fsdp:
        raise ValueError(
            "FullyShardedDataParallel needs DistributedDataParallelConfig(use_megatron_fsdp=True); for plain data "
            "parallelism wrap the model in DistributedDataParallel instead"
        )
    strategy = ddp_config.data_parallel_sharding_strategy
    if ddp_config.megatron_fsdp_grad_comm_dtype is not None and strategy not in _SHARDED_GRADS:
        raise ValueError(
            f"megatron_fsdp_grad_comm_dtype with data_parallel_sharding_strategy={strategy!r}: only the sharded-"
            f"gradient strategies {_SHARDED_GRADS} cast the reduce-scatter; use one of them or leave it None"
        )
