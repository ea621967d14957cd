"""Megatron FSDP's buffers: a DDP buffer whose gradients (ZeRO-2) and parameters (ZeRO-3) live as shards.

One :class:`ShardedParamAndGradBuffer` holds the parameters of one FSDP unit (a transformer layer) of one dtype
pair, laid out like the distributed optimizer's buffers (one bucket, padded to a multiple of the data-parallel
size, rank ``r`` owning the ``r``-th equal slice). What differs from DDP is what stays allocated:

- gradients: the full flat gradient tensor exists only while backward fills it; once the unit's gradients are all
  in, it is reduce-scattered, this rank's slice is added into ``grad_shard`` (the only gradient memory kept between
  steps) and the full tensor's storage is freed. ``param.main_grad`` then is this rank's piece of the parameter's
  gradient (a flat, possibly empty view of ``grad_shard``), which is what ``finalize_model_grads`` reduces over
  TP / the embedding group: the layout is the same on every rank of those groups, so the pieces line up.
- parameters (``shard_params``): ``param_shard`` holds this rank's slice; the full flat tensor that ``param.data``
  views is all-gathered just before the unit runs (forward, and again before its backward) and freed after.

Storage is freed by shrinking it to zero bytes (``untyped_storage().resize_(0)``) and regrown in place, so every
view (``param.data``, ``main_grad``, autograd's saved tensors) stays attached to the same storage.
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.param_and_grad_buffer import (
    _all_gather_single,
    _ParamAndGradBucketGroup,
    _ParamAndGradBuffer,
    _reduce_scatter_single,
)


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _regrow(tensor: torch.Tensor) -> bool:
    """Give ``tensor`` its storage back (uninitialised); False when it already had it."""
    storage = tensor.untyped_storage()
    if storage.nbytes() > 0:
        return False
    storage.resize_(tensor.numel() * tensor.element_size())
    return True


class ShardedParamAndGradBuffer(_ParamAndGradBuffer):
    """A DDP buffer (one bucket) whose gradients, and with ``shard_params`` parameters, are kept as this rank's
    shard between uses (see the module docstring). ``grad_comm_dtype``: the dtype of the reduce-scatter (None:
    the gradient dtype)."""

    def __init__(self, *args, shard_params: bool, grad_comm_dtype: Optional[torch.dtype] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if len(self.buckets) != 1:
            raise ValueError("a Megatron FSDP buffer holds exactly one bucket (one FSDP unit)")
        world, rank = self.data_parallel_world_size, dist.get_rank(self.data_parallel_group)
        self.shard_numel = self.numel // world
        self.shard_start = rank * self.shard_numel
        self.shard_params = shard_params
        self.grad_comm_dtype = grad_comm_dtype or self.grad_dtype
        self.grad_shard = torch.zeros(self.shard_numel, dtype=self.grad_dtype, device=self.grad_data.device)
        self._full_main_grads = {param: param.main_grad for param in self.params}
        self._grad_pieces = {param: self._piece(self.grad_shard, param) for param in self.params}
        self._pending_reduce = None
        self.grads_allocated = True
        self._release_grads()
        self.param_shard = None
        self._pending_gather = None
        self.params_gathered = True
        if shard_params:
            self.param_shard = self.param_data[self.shard_start : self.shard_start + self.shard_numel].clone()
            self.release_params()

    def _piece(self, shard: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
        """The part of ``param`` inside this rank's shard, as a flat view of ``shard`` (empty when none)."""
        start, end, _ = self.param_index_map[param]
        lo, hi = max(start, self.shard_start), min(end, self.shard_start + self.shard_numel)
        if hi <= lo:
            return shard[:0]
        return shard[lo - self.shard_start : hi - self.shard_start]

    def _local(self, shard: torch.Tensor, param, start: int, end: int) -> torch.Tensor:
        offset = self.param_index_map[param][0] + start - self.shard_start
        if offset < 0 or offset + (end - start) > self.shard_numel:
            raise ValueError(f"elements [{start}, {end}) of a parameter lie outside this rank's FSDP shard")
        return shard[offset : offset + (end - start)]

    # ---- where the distributed optimizer reads and writes ------------------------------------------------------

    def param_shard_view(self, param, start: int, end: int) -> torch.Tensor:
        if self.param_shard is None:
            return super().param_shard_view(param, start, end)
        return self._local(self.param_shard, param, start, end)

    def grad_shard_view(self, param, start: int, end: int) -> torch.Tensor:
        return self._local(self.grad_shard, param, start, end)

    # ---- gradients -------------------------------------------------------------------------------------------

    def allocate_grads(self) -> None:
        """Before backward adds into ``main_grad``: a zeroed full gradient tensor (first, finish a pending
        reduction of the previous micro-batch, which still reads it)."""
        self.finish_grad_reduce()
        if self.grads_allocated:
            return
        _regrow(self.grad_data)
        self.grad_data.zero_()
        for param, full in self._full_main_grads.items():
            param.main_grad = full
        self.grads_allocated = True

    def _release_grads(self) -> None:
        _free(self.grad_data)
        for param, piece in self._grad_pieces.items():
            param.main_grad = piece
        self.grads_allocated = False

    def launch_grad_reduce(self, op, async_op: bool) -> None:
        """Reduce-scatter the full gradients (scaled for the DP mean) toward this rank's shard."""
        if not self.grads_allocated or self._pending_reduce is not None:
            return
        bucket = self.buckets[0]
        if bucket.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(bucket.gradient_scaling_factor)
        source = self.grad_data if self.grad_comm_dtype == self.grad_dtype else self.grad_data.to(self.grad_comm_dtype)
        output = torch.empty(self.shard_numel, dtype=self.grad_comm_dtype, device=source.device)
        handle = _reduce_scatter_single(output, source, op=op, group=self.data_parallel_group, async_op=async_op)
        self._pending_reduce = (handle, output, source)

    def finish_grad_reduce(self) -> None:
        """Wait for the launched reduce-scatter, add the result into ``grad_shard``, free the full gradients."""
        if self._pending_reduce is None:
            return
        handle, output, _ = self._pending_reduce
        if handle is not None:
            handle.wait()
        self._pending_reduce = None
        self.grad_shard.add_(output.to(self.grad_dtype))
        self._release_grads()

    def scale_gradients(self, scaling_factor) -> None:
        self.grad_shard.mul_(scaling_factor)
        if self.grads_allocated:
            self.grad_data.mul_(scaling_factor)

    def reset(self) -> None:
        """Zero the gradient shard for the next step (gradients of an abandoned step are dropped)."""
        if self._pending_reduce is not None:
            self.finish_grad_reduce()
        if self.grads_allocated:
            self._release_grads()
        self.grad_shard.zero_()

    def offload_grad_data(self) -> None:
        _free(self.grad_shard)

    def restore_grad_data(self) -> None:
        _regrow(self.grad_shard)
        self.grad_shard.zero_()

    # ---- parameters (optim_grads_params) ---------------------------------------------------------------------

    def gather_params(self, async_op: bool = False) -> None:
        """All-gather the full parameters from the shards (no-op when gathered or being gathered)."""
        if self.param_shard is None or self.params_gathered:
            return
        _regrow(self.param_data)
        group = self.data_parallel_group
        self._pending_gather = _all_gather_single(self.param_data, self.param_shard, group=group, async_op=async_op)
        self.params_gathered = True

    def wait_params(self) -> None:
        if self._pending_gather is not None:
            self._pending_gather.wait()
            self._pending_gather = None

    def release_params(self) -> None:
        """Free the full parameters (the shard stays)."""
        if self.param_shard is None or not self.params_gathered:
            return
        self.wait_params()
        _free(self.param_data)
        self.params_gathered = False

    def copy_shard_from_full(self) -> None:
        """After the full parameters were written (a checkpoint load): take this rank's slice as the shard."""
        if self.param_shard is not None:
            self.param_shard.copy_(self.param_data[self.shard_start : self.shard_start + self.shard_numel])


class ShardedBucketGroup(_ParamAndGradBucketGroup):
    """The communication unit of one :class:`ShardedParamAndGradBuffer`: reduce-scatters each micro-batch's
    gradients as soon as the unit's backward is done (no_sync does not defer it: only the shard is kept), and
    with sharded parameters frees them then."""

    def __init__(self, buffer: ShardedParamAndGradBuffer):
        super().__init__(buffer.buckets, buffer.ddp_config, buffer.data_parallel_group, buffer.param_to_name)
        self.buffer = buffer

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        self._refuse_all_reduce(force_all_reduce)
        self.params_with_grad = set()
        if not self.buffer.grads_allocated:
            return
        if self.ddp_config.check_for_nan_in_grad:
            self.check_grads()
        self.buffer.launch_grad_reduce(self._reduce_op(), async_op=self.ddp_config.overlap_grad_reduce)
        # Backward is done with this unit's weights.
        self.buffer.release_params()
        if not self.ddp_config.overlap_grad_reduce:
            self.buffer.finish_grad_reduce()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Reduce what backward left unreduced (units with unused parameters), wait for everything."""
        self._refuse_all_reduce(force_all_reduce)
        self.start_grad_sync()
        self.buffer.finish_grad_reduce()

    @staticmethod
    def _refuse_all_reduce(force_all_reduce: bool) -> None:
        if force_all_reduce:
            raise ValueError(
                "force_all_reduce=True: Megatron FSDP with data_parallel_sharding_strategy 'optim_grads' or "
                "'optim_grads_params' keeps only each rank's gradient shard; use 'optim' to all-reduce gradients"
            )

    def start_param_sync(self, force_sync: bool = False) -> None:
        if self.buffer.shard_params:
            # The optimizer updated the shard: the full parameters are stale; the next use gathers them.
            self.buffer.release_params()
            self.param_gather_dispatched = True
            return
        super().start_param_sync(force_sync=force_sync)

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        if self.buffer.shard_params:
            return  # gathered by the FSDP unit hooks
        super().finish_param_sync(skip_next_bucket_dispatch)
