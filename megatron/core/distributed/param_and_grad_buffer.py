"""Contiguous parameter and gradient buffers, split into buckets that are reduced as units.

A :class:`_ParamAndGradBuffer` holds every parameter of one (param dtype, grad dtype) pair in one flat gradient
tensor (``param.main_grad`` is a view into it) and, with the distributed optimizer, one flat parameter tensor
(``param.data`` becomes a view into it). Parameters are laid out in reverse registration order, which is roughly the
order backward produces their gradients, and the buffer is cut into buckets of about ``bucket_size`` elements.

A :class:`_ParamAndGradBucketGroup` is the unit of communication: when the last gradient of its buckets is ready
(with ``overlap_grad_reduce``) it launches their all-reduce, or reduce-scatter for the distributed optimizer,
asynchronously; ``finish_grad_sync`` waits. With the distributed optimizer it also all-gathers the updated
parameters, optionally one bucket group ahead of the forward pass (``overlap_param_gather``).

The layout (where each parameter and bucket lives, with the distributed optimizer's padding rules) is computed in
``param_layout.py``, or given precomputed (``DistributedOptimizer.compute_full_param_layout``).
"""

import logging
from enum import Enum
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig

# BufferKey and group_params_for_buffers are re-exported: Megatron-Core has them in this module.
from megatron.core.distributed.param_layout import (  # noqa: F401
    BufferKey,
    PerBufferParamLayout,
    compute_per_buffer_param_layout,
    group_params_for_buffers,
)

logger = logging.getLogger(__name__)

# torch >= 2.11 names the single-tensor collectives *_single; older releases only have *_tensor.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class BufferType(Enum):
    """Which flat tensor of a :class:`_ParamAndGradBuffer` a view is taken from."""

    PARAM = 1
    GRAD = 2


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> List[torch.Tensor]:
    """Equal contiguous views of ``buffer``, one per data-parallel rank (its numel must divide evenly)."""
    shard_size = buffer.numel() // data_parallel_world_size
    return [buffer[r * shard_size : (r + 1) * shard_size] for r in range(data_parallel_world_size)]


class _ParamAndGradBucket:
    """A contiguous slice of a buffer: its parameters and the views of their data and gradients."""

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        param_data: Optional[torch.Tensor],
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        gradient_scaling_factor: float,
        bucket_id: int,
        param_to_index: Dict[torch.nn.Parameter, tuple],
    ):
        self.params_list = params
        self.params = set(params)
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        self.param_to_index = param_to_index


class _ParamAndGradBucketGroup:
    """Buckets that are reduced (and, for the distributed optimizer, all-gathered) together."""

    def __init__(
        self,
        buckets: List[_ParamAndGradBucket],
        ddp_config: DistributedDataParallelConfig,
        collective_group: dist.ProcessGroup,
        param_to_name: Dict[torch.nn.Parameter, str],
        iteration: Optional[Callable[[], int]] = None,
    ):
        self.buckets = buckets
        self.ddp_config = ddp_config
        self.data_parallel_group = collective_group
        self.data_parallel_world_size = dist.get_world_size(collective_group)
        self.data_parallel_rank = dist.get_rank(collective_group)
        self.param_to_name = param_to_name
        self.iteration = iteration or (lambda: "?")
        self.params = set().union(*(bucket.params for bucket in buckets))
        self.next_param_gather_bucket_group: Optional["_ParamAndGradBucketGroup"] = None
        self.param_gather_handles: List = []
        self.param_gather_dispatched = False
        self.reset()

    def reset(self) -> None:
        """Forget this step's gradient bookkeeping (the buffer itself is zeroed by the owner)."""
        self.is_last_microbatch = True
        self.params_with_grad = set()
        self.grad_reduce_handles: Optional[List] = None
        self.grad_reduce_scattered = False

    # ---- gradients -------------------------------------------------------------------------------------------

    def check_grads(self) -> None:
        """Raise if a local gradient of these buckets is NaN or Inf, naming the rank, iteration and parameters."""
        for bucket in self.buckets:
            if torch.isfinite(bucket.grad_data).all():
                continue
            bad = sorted(
                self.param_to_name.get(p, "<unnamed>")
                for p in bucket.params_list
                if not torch.isfinite(p.main_grad).all()
            )
            raise RuntimeError(
                f"rank {dist.get_rank()}: found NaN or Inf in local gradients at iteration {self.iteration()} "
                f"(bucket {bucket.bucket_id}, parameters {bad}) before the data-parallel reduction; "
                "check the loss and the learning rate, or use loss scaling with fp16"
            )

    def _reduce_op(self):
        return dist.ReduceOp.AVG if self.ddp_config.average_in_collective else dist.ReduceOp.SUM

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Launch the reduction of every bucket: asynchronous with ``overlap_grad_reduce``, else blocking.

        With the distributed optimizer each rank receives only its shard (reduce-scatter) unless
        ``force_all_reduce``.
        """
        if self.grad_reduce_handles is not None:
            raise RuntimeError("start_grad_sync called twice for the same bucket group without finish_grad_sync")
        # Check before the collective: once reduced, every rank would hold the NaN and its origin would be lost.
        if self.ddp_config.check_for_nan_in_grad:
            self.check_grads()
        async_op = self.ddp_config.overlap_grad_reduce
        handles = []
        self.grad_reduce_scattered = self.ddp_config.use_distributed_optimizer and not force_all_reduce
        for bucket in self.buckets:
            # Pre-scale so the SUM (or AVG) collective yields the DP(+CP) mean; see DDP._gradient_scaling_factors.
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data.mul_(bucket.gradient_scaling_factor)
            if self.grad_reduce_scattered:
                # The output is this rank's own slice of the bucket, so the reduced shard lands in place;
                # the other slices keep this rank's unreduced values, which the distributed optimizer never reads.
                local_shard = shard_buffer(bucket.grad_data, self.data_parallel_world_size)[self.data_parallel_rank]
                handle = _reduce_scatter_single(
                    local_shard,
                    bucket.grad_data,
                    op=self._reduce_op(),
                    group=self.data_parallel_group,
                    async_op=async_op,
                )
            else:
                handle = dist.all_reduce(
                    bucket.grad_data, op=self._reduce_op(), group=self.data_parallel_group, async_op=async_op
                )
            # Blocking collectives return None.
            if handle is not None:
                handles.append(handle)
        self.grad_reduce_handles = handles

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Make this step's reduction complete: wait for the launched one, or run it now.

        With ``overlap_grad_reduce`` a bucket whose parameters did not all receive a gradient this step (an unused
        layer) was never launched by the backward hooks; it is reduced here instead, so results stay correct.
        ``force_all_reduce`` leaves every rank the fully reduced gradients: an all-reduce when nothing was launched
        yet, or, after an already launched reduce-scatter, an all-gather of the reduced shards.
        """
        if self.grad_reduce_handles is None:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        for handle in self.grad_reduce_handles:
            handle.wait()
        self.grad_reduce_handles = None
        # A reduce-scatter had already been launched (hooks or grad_sync_func), so only this rank's shard is
        # reduced: gather the shards to give every rank the full reduced gradient.
        if force_all_reduce and self.grad_reduce_scattered:
            for bucket in self.buckets:
                local_shard = shard_buffer(bucket.grad_data, self.data_parallel_world_size)[self.data_parallel_rank]
                _all_gather_single(bucket.grad_data, local_shard.clone(), group=self.data_parallel_group)

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Backward hook side: once every parameter of the group has its gradient, launch the reduction."""
        # Inside no_sync (not the last micro-batch) gradients only accumulate; without overlap the
        # schedule reduces everything at once via finish_grad_sync.
        if not (self.ddp_config.overlap_grad_reduce and self.is_last_microbatch):
            return
        self.params_with_grad.add(param)
        # Launch only when the whole group is ready; a group with unused parameters is reduced in finish_grad_sync.
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()

    # ---- parameters (distributed optimizer) ------------------------------------------------------------------

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather every bucket's updated parameter shards (asynchronously with ``overlap_param_gather``)."""
        if not self.ddp_config.use_distributed_optimizer:
            raise RuntimeError("parameter all-gather only exists with use_distributed_optimizer=True")
        # An earlier gather still in flight writes into the same param_data; let it finish first.
        self._wait_param_gather()
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        for bucket in self.buckets:
            # Each rank's optimizer wrote only its own shard in place; the gather fills in the other ranks' shards.
            local_shard = shard_buffer(bucket.param_data, self.data_parallel_world_size)[self.data_parallel_rank]
            handle = _all_gather_single(
                bucket.param_data, local_shard, group=self.data_parallel_group, async_op=async_op
            )
            if handle is not None:
                self.param_gather_handles.append(handle)
        self.param_gather_dispatched = True

    def _wait_param_gather(self) -> None:
        for handle in self.param_gather_handles:
            handle.wait()
        self.param_gather_handles = []

    def free_overlap_buffers(self) -> None:
        """Complete any in-flight parameter all-gather and drop its handle (gathers write into the parameter
        buffer in place, so there is no separate gather buffer to release)."""
        self._wait_param_gather()

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Before the forward uses these parameters: make sure they are gathered, and prefetch the next group."""
        if not self.param_gather_dispatched:
            self.start_param_sync()
        self._wait_param_gather()
        # Prefetch: the next group's gather then overlaps this group's forward compute.
        following = self.next_param_gather_bucket_group
        if following is not None and not skip_next_bucket_dispatch and not following.param_gather_dispatched:
            following.start_param_sync()


class _ParamAndGradBuffer:
    """Flat parameter and gradient storage for parameters of one dtype pair, cut into buckets."""

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: List[torch.nn.Parameter],
        data_parallel_group: dist.ProcessGroup,
        bucket_size: Optional[int],
        param_to_name: Dict[torch.nn.Parameter, str],
        gradient_scaling_factor: float,
        param_layout: Optional[PerBufferParamLayout] = None,
    ):
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.params = params
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = dist.get_world_size(data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_to_name = param_to_name

        if param_layout is None:
            dp_size = self.data_parallel_world_size
            param_layout = compute_per_buffer_param_layout(params, bucket_size, dp_size, ddp_config)
        _check_layout(param_layout, params, self.data_parallel_world_size, ddp_config)
        self.param_index_map = param_layout.param_index_map
        self.bucket_indices = param_layout.bucket_indices
        self.num_optimizer_shards = param_layout.num_optimizer_shards
        self.numel = self.bucket_indices[-1][1]
        # As in Megatron: up to each bucket's last parameter, alignment padding between parameters included.
        self.numel_unpadded = sum(param_layout.per_bucket_numel_unpadded)
        device = params[0].device
        # Zeroed because main_grad views are accumulated into with add_ from the first micro-batch on.
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if ddp_config.use_distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        self._attach_params()
        bucket_params = [[] for _ in self.bucket_indices]
        for param, (_, _, bucket_id) in self.param_index_map.items():
            bucket_params[bucket_id].append(param)
        unpadded_sizes = param_layout.per_bucket_numel_unpadded
        self.buckets = [
            self._make_bucket(i, start, end, start + unpadded, bucket_params[i])
            for i, ((start, end), unpadded) in enumerate(zip(self.bucket_indices, unpadded_sizes))
        ]
        self.param_to_bucket = {p: bucket for bucket in self.buckets for p in bucket.params_list}

    def _get(self, shape: torch.Size, start_index: int, buffer_type: BufferType) -> torch.Tensor:
        """A view of ``shape`` starting at ``start_index`` in the parameter or the gradient buffer."""
        buffer = self.param_data if buffer_type == BufferType.PARAM else self.grad_data
        if buffer is None:
            raise RuntimeError("this buffer keeps no parameter storage (use_distributed_optimizer=False)")
        end_index = start_index + shape.numel()
        if end_index > self.numel:
            raise ValueError(f"requested [{start_index}, {end_index}) lies outside the buffer of {self.numel} elements")
        return buffer[start_index:end_index].view(shape)

    def _attach_params(self) -> None:
        """Point ``main_grad`` (and, with the distributed optimizer, ``data``) of every parameter into the buffer."""
        for param, (start, _, _) in self.param_index_map.items():
            if self.param_data is not None:
                view = self._get(param.data.shape, start, BufferType.PARAM)
                # Copy before rebinding: param.data then aliases the buffer that the param all-gather fills.
                view.copy_(param.data)
                param.data = view
            param.main_grad = self._get(param.data.shape, start, BufferType.GRAD)

    def _make_bucket(self, bucket_id: int, start: int, end: int, unpadded_end: int, params) -> _ParamAndGradBucket:
        param_to_index = {}
        for param in params:
            param_start, param_end, _ = self.param_index_map[param]
            # Bucket-relative offsets, for indexing into the bucket's own grad_data/param_data views.
            param_to_index[param] = (param_start - start, param_end - start)
        return _ParamAndGradBucket(
            params=params,
            param_data=None if self.param_data is None else self.param_data[start:end],
            grad_data=self.grad_data[start:end],
            offset=start,
            numel_unpadded=unpadded_end - start,
            gradient_scaling_factor=self.gradient_scaling_factor,
            bucket_id=bucket_id,
            param_to_index=param_to_index,
        )

    def param_shard_view(self, param: torch.nn.Parameter, start: int, end: int) -> torch.Tensor:
        """Flat elements ``[start, end)`` of ``param`` where the distributed optimizer reads and writes them: the
        parameter itself here (FSDP's buffers keep the shard apart)."""
        return param.detach().view(-1)[start:end]

    def grad_shard_view(self, param: torch.nn.Parameter, start: int, end: int) -> torch.Tensor:
        """Flat elements ``[start, end)`` of ``param``'s reduced gradient (its ``main_grad`` here)."""
        return param.main_grad.view(-1)[start:end]

    def scale_gradients(self, scaling_factor) -> None:
        """Multiply every gradient in the buffer by ``scaling_factor`` (a float or a 0-d tensor)."""
        self.grad_data.mul_(scaling_factor)

    def reset(self) -> None:
        """Zero the gradient buffer for the next step."""
        self.grad_data.zero_()

    def offload_grad_data(self) -> None:
        """Free the gradient buffer's memory; every view of it (main_grad, buckets) stays but must not be read."""
        # Shrink the storage rather than dropping the tensor so main_grad and bucket views stay attached.
        self.grad_data.untyped_storage().resize_(0)

    def restore_grad_data(self) -> None:
        """Reallocate the gradient buffer's memory, zeroed, under the same views."""
        storage = self.grad_data.untyped_storage()
        if storage.nbytes() == 0:
            # Regrow the same storage so the existing views point at valid memory again.
            storage.resize_(self.numel * self.grad_data.element_size())
        self.grad_data.zero_()


def _check_layout(layout: PerBufferParamLayout, params, data_parallel_world_size: int, ddp_config) -> None:
    """A given layout must place exactly this buffer's parameters, padded for this data-parallel size."""
    if set(layout.param_index_map) != set(params):
        raise ValueError(
            "the parameter layout does not place exactly this buffer's parameters; compute it with "
            "DistributedOptimizer.compute_full_param_layout over the module's parameters"
        )
    if ddp_config.use_distributed_optimizer and layout.num_optimizer_shards != data_parallel_world_size:
        raise ValueError(
            f"the parameter layout was padded for {layout.num_optimizer_shards} optimizer shards but the buffer is "
            f"reduced over {data_parallel_world_size} data-parallel ranks; compute it for this group's size"
        )


def partition_buckets(
    buffers: List[_ParamAndGradBuffer],
    force_single_bucket_group: bool = False,
    reduce_scatter_with_fp32_accumulation: bool = False,
) -> List[_ParamAndGradBucketGroup]:
    """Bucket groups, the units of communication: one per bucket, in buffer order (the order backward fills them);
    with ``force_single_bucket_group`` one group holding every bucket of every buffer (all reduced at once).

    The buffers must share one data-parallel group. ``reduce_scatter_with_fp32_accumulation`` is not supported
    yet and must be False.
    """
    if reduce_scatter_with_fp32_accumulation:
        raise ValueError(
            "not supported yet: reduce-scatter with fp32 accumulation (reduce_scatter_with_fp32_accumulation=True)"
        )
    if not buffers:
        return []
    groups = {id(buffer.data_parallel_group) for buffer in buffers}
    # A bucket group issues all of its collectives on a single process group.
    if len(groups) > 1:
        raise ValueError("partition_buckets: the buffers reduce over different data-parallel groups")
    first = buffers[0]
    if force_single_bucket_group:
        buckets = [bucket for buffer in buffers for bucket in buffer.buckets]
        return [_ParamAndGradBucketGroup(buckets, first.ddp_config, first.data_parallel_group, first.param_to_name)]
    return [
        _ParamAndGradBucketGroup([bucket], buffer.ddp_config, buffer.data_parallel_group, buffer.param_to_name)
        for buffer in buffers
        for bucket in buffer.buckets
    ]
