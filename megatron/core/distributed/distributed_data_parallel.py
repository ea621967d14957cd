"""DistributedDataParallel: Megatron-style data parallelism over contiguous, bucketed gradient buffers.

Each parameter's gradient is accumulated into ``param.main_grad`` (a view into a flat buffer) by a hook that runs
right after autograd accumulates ``param.grad``; ``param.grad`` is then dropped, so gradients live only in the
buffers. Reduction is bucket by bucket: at ``finish_grad_sync`` (called by ``finalize_model_grads``) or, with
``overlap_grad_reduce``, as soon as a bucket's last gradient arrives during backward. Dense parameters are reduced
over the data-parallel group with context parallelism folded in; expert parameters (``param.allreduce == False``)
over the expert data-parallel group.

Typical step::

    model.zero_grad_buffer(); optimizer.zero_grad()
    with model.no_sync():                     # all micro-batches but the last
        ...forward/backward...
    ...forward/backward of the last micro-batch...
    finalize_model_grads([model])             # finish_grad_sync + tied-embedding / SP reductions
    optimizer.step()
"""

import logging
import weakref
from contextlib import contextmanager
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.param_layout import FullParamLayout
from megatron.core.distributed.param_and_grad_buffer import (
    _ParamAndGradBuffer,
    group_params_for_buffers,
    partition_buckets,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import synchronize_device

logger = logging.getLogger(__name__)

DEFAULT_MIN_BUCKET_SIZE = 40_000_000
DEFAULT_BUCKET_SIZE_PER_DP_RANK = 1_000_000


class DistributedDataParallel(MegatronModule):
    """Wrap ``module`` for data-parallel training (see the module docstring).

    Args:
        config: the model's TransformerConfig / ModelParallelConfig (``calculate_per_token_loss`` is read from it).
        ddp_config: how to bucket and reduce.
        module: the model chunk to wrap.
        disable_bucketing: put all parameters of a dtype in one bucket, and all buckets in one group (no overlap
            with backward).
        pg_collection: explicit groups (``dp_cp`` and ``expt_dp`` are used); default the parallel_state groups.
        full_param_layout: every buffer's layout, precomputed (``DistributedOptimizer.compute_full_param_layout``,
            a ``FullParamLayout``); None: the buffers compute the same layout themselves.
    """

    # megatron.core.utils.unwrap_model strips classes that carry this marker.
    _megatron_model_wrapper = True

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
        full_param_layout: Optional[FullParamLayout] = None,
    ):
        super().__init__(config)
        self.module = module
        self.ddp_config = ddp_config
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["dp_cp", "expt_dp"])
        self.dp_cp_group = pg_collection.dp_cp
        self.expt_dp_group = pg_collection.expt_dp
        self.iteration = 0
        """Counts zero_grad_buffer calls (one per training step); trainers that resume may set it."""

        dp_cp_size = dist.get_world_size(self.dp_cp_group)
        self.bucket_size = self._bucket_size(dp_cp_size, disable_bucketing)
        dense_factor, expert_factor = self._gradient_scaling_factors(config, dp_cp_size)

        self.param_to_name = {}
        dense, expert = [], []
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            self.param_to_name[param] = name
            param.grad_added_to_main_grad = False
            (dense if getattr(param, "allreduce", True) else expert).append(param)

        self.full_param_layout = full_param_layout
        self.buffers = self._allocate_buffers(dense, self.dp_cp_group, dense_factor)
        self.expert_parallel_buffers = self._allocate_buffers(expert, self.expt_dp_group, expert_factor)
        self.bucket_groups = self._partition_buckets(self.buffers, disable_bucketing)
        self.expert_parallel_bucket_groups = self._partition_buckets(self.expert_parallel_buffers, disable_bucketing)
        self._all_bucket_groups = self.bucket_groups + self.expert_parallel_bucket_groups
        for group in self._all_bucket_groups:
            group.iteration = lambda: self.iteration  # named in NaN reports
        # Parameters are gathered in forward order, the reverse of the (backward-ordered) bucket groups.
        forward_order = list(reversed(self.bucket_groups)) + list(reversed(self.expert_parallel_bucket_groups))
        for current, following in zip(forward_order, forward_order[1:]):
            current.next_param_gather_bucket_group = following
        self.param_to_bucket_group = {p: group for group in self._all_bucket_groups for p in group.params}

        # The hook reaches this wrapper through a weak reference: a hook held by a parameter is out of the garbage
        # collector's sight once autograd holds the parameter too, so a strong one would keep the wrapper (and its
        # process groups, with their threads) alive after the caller drops it.
        this = weakref.ref(self)
        self._grad_accumulation_hooks = [
            param.register_post_accumulate_grad_hook(lambda param: this()._accumulate_into_main_grad(param))
            for param in self.param_to_bucket_group
        ]
        self._param_gather_hooks = []
        if ddp_config.overlap_param_gather:
            self.enable_forward_pre_hook()

    # ---- construction helpers --------------------------------------------------------------------------------

    def _bucket_size(self, dp_size: int, disable_bucketing: bool) -> Optional[int]:
        """Elements per bucket; None means one bucket per buffer (nothing to overlap without overlap_grad_reduce)."""
        if disable_bucketing or not self.ddp_config.overlap_grad_reduce:
            return None
        if self.ddp_config.bucket_size is not None:
            return self.ddp_config.bucket_size
        return max(DEFAULT_MIN_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DP_RANK * dp_size)

    def _gradient_scaling_factors(self, config, dp_cp_size: int):
        """What to multiply dense and expert gradients by before the (sum or average) collective.

        Gradients are averaged over all DP(+CP) ranks; expert gradients are reduced over the smaller expert-DP
        group but must be averaged over the same DP(+CP) count. With per-token loss nothing is divided here:
        finalize_model_grads divides by the global token count.
        """
        expt_dp_size = dist.get_world_size(self.expt_dp_group)
        if getattr(config, "calculate_per_token_loss", False):
            if self.ddp_config.average_in_collective:
                raise ValueError(
                    "average_in_collective=True cannot be used with calculate_per_token_loss=True (gradients are "
                    "summed and divided by the token count); turn average_in_collective off"
                )
            return 1.0, 1.0
        if self.ddp_config.average_in_collective:
            return 1.0, expt_dp_size / dp_cp_size
        return 1.0 / dp_cp_size, 1.0 / dp_cp_size

    def _allocate_buffers(self, params: List[torch.nn.Parameter], group, scaling_factor: float):
        """One buffer per (param dtype, grad dtype), keeping the parameters' registration order, laid out as
        ``full_param_layout`` says when one was given."""
        buffers = []
        for key, (dtype_params, _) in group_params_for_buffers(params, self.ddp_config.grad_reduce_in_fp32).items():
            layout = None
            if self.full_param_layout is not None:
                layout = self.full_param_layout.layouts.get(key)
                if layout is None:
                    raise ValueError(
                        f"full_param_layout has no layout for the buffer {key}; compute it with "
                        "DistributedOptimizer.compute_full_param_layout over this module's parameters"
                    )
            buffers.append(
                _ParamAndGradBuffer(
                    self.ddp_config,
                    key.param_dtype,
                    key.grad_dtype,
                    dtype_params,
                    group,
                    self.bucket_size,
                    self.param_to_name,
                    scaling_factor,
                    param_layout=layout,
                )
            )
        return buffers

    def _partition_buckets(self, buffers, disable_bucketing: bool):
        """The bucket groups (units of communication) of ``buffers``; FSDP builds its own."""
        return partition_buckets(buffers, force_single_bucket_group=disable_bucketing)

    # ---- hooks -----------------------------------------------------------------------------------------------

    def _accumulate_into_main_grad(self, param: torch.nn.Parameter) -> None:
        """Runs after autograd accumulated ``param.grad``: move it into the buffer, maybe launch the bucket."""
        if param.grad is not None and not param.grad_added_to_main_grad:
            param.main_grad.add_(param.grad)
        param.grad = None
        self.param_to_bucket_group[param].register_grad_ready(param)

    def _wait_for_params_before_forward(self, module, args):
        for param in module.parameters(recurse=False):
            group = self.param_to_bucket_group.get(param)
            if group is not None:
                group.finish_param_sync()

    def enable_forward_pre_hook(self) -> None:
        """Make each submodule wait for its parameters' all-gather before its forward (overlap_param_gather)."""
        if self._param_gather_hooks:
            return
        self._param_gather_hooks = [
            module.register_forward_pre_hook(self._wait_for_params_before_forward) for module in self.module.modules()
        ]

    def disable_forward_pre_hook(self, param_sync: bool = True):
        """Remove the forward pre-hooks; with ``param_sync`` first gather every parameter (e.g. before saving)."""
        for handle in self._param_gather_hooks:
            handle.remove()
        self._param_gather_hooks = []
        if param_sync:
            self.start_param_sync(force_sync=True)

    # ---- the public step API ---------------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them (every micro-batch but the last)."""
        for group in self._all_bucket_groups:
            group.is_last_microbatch = False
        try:
            yield
        finally:
            for group in self._all_bucket_groups:
                group.is_last_microbatch = True

    def start_grad_sync(self, *unused) -> None:
        """Launch the reduction of every bucket not already launched by the backward hooks (the pipeline
        schedules call this, as ``config.grad_sync_func``, once a chunk's last backward is done)."""
        for group in self._all_bucket_groups:
            if group.grad_reduce_handles is None:
                group.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False):
        """Complete the reduction of every bucket (launching those that have not been launched).

        ``force_all_reduce``: with the distributed optimizer, leave every rank the fully reduced gradients (an
        all-reduce) instead of only its shard (a reduce-scatter).
        """
        for group in self._all_bucket_groups:
            group.finish_grad_sync(force_all_reduce=force_all_reduce)

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        """All-gather the updated parameters (distributed optimizer): blocking with ``force_sync``, else async.

        Bucket groups whose gather has already been dispatched this step are skipped unless ``force_sync`` or
        ``force_dispatch`` (which gathers them again, e.g. after parameters were changed outside the optimizer).
        """
        for group in self._all_bucket_groups:
            if force_sync or force_dispatch or not group.param_gather_dispatched:
                group.start_param_sync(force_sync=force_sync)

    def free_overlap_buffers(self):
        """Let no parameter all-gather stay in flight (e.g. before an asynchronous checkpoint save copies the
        parameters): wait for every dispatched gather. Gathers write into the parameter buffers in place, so no
        temporary gather buffers exist to be freed."""
        for group in self._all_bucket_groups:
            group.free_overlap_buffers()

    def reset_param_sync_dispatch_state(self):
        """Forget which parameter all-gathers were dispatched, so the next forward (``overlap_param_gather``) or
        ``start_param_sync`` dispatches every bucket group again."""
        for group in self._all_bucket_groups:
            group.param_gather_dispatched = False

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        """Release the memory of every gradient buffer (e.g. while the model only runs inference).

        The buffers' storage shrinks to nothing while ``param.main_grad`` and the buckets' views stay valid objects;
        reading them before :meth:`restore_grad_buffers` is an error. ``synchronize`` first waits for queued device
        work; ``empty_cache`` hands the freed memory back to the device allocator.
        """
        if synchronize:
            synchronize_device()
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.offload_grad_data()
        if empty_cache and torch.accelerator.is_available():
            torch.accelerator.empty_cache()

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        """Give the gradient buffers their memory back, zeroed; every existing view sees it again."""
        if synchronize:
            synchronize_device()
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.restore_grad_data()

    def mark_params_updated(self, buffers=None) -> None:
        """Called by the distributed optimizer after a step: parameter shards changed and must be gathered.

        ``buffers`` limits this to the buffers that optimizer steps (a dense and an expert optimizer each gather
        their own). Without ``overlap_param_gather`` the gather happens right away; with it, each bucket group is
        gathered just before the forward first needs it, one group ahead.
        """
        if buffers is None:
            groups = self._all_bucket_groups
        else:
            updated = {id(bucket) for buffer in buffers for bucket in buffer.buckets}
            groups = [g for g in self._all_bucket_groups if any(id(b) in updated for b in g.buckets)]
        for group in groups:
            if self.ddp_config.overlap_param_gather:
                group.param_gather_dispatched = False  # gathered just before the forward needs it
            else:
                group.start_param_sync(force_sync=True)

    def _finish_pending_param_gathers(self) -> None:
        if self.ddp_config.overlap_param_gather:
            for group in self._all_bucket_groups:
                group.finish_param_sync(skip_next_bucket_dispatch=True)

    def scale_gradients(self, scaling_factor) -> None:
        """Multiply every gradient in the buffers by ``scaling_factor``."""
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer and reset the bucket bookkeeping: call at the start of each step."""
        self.iteration += 1
        for param in self.param_to_bucket_group:
            param.grad_added_to_main_grad = False
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.reset()
        for group in self._all_bucket_groups:
            group.reset()

    def broadcast_params(self) -> None:
        """Copy data-parallel rank 0's parameters to every DP rank (dense over DP+CP, experts over expert-DP)."""
        for param in self.module.parameters():
            group = self.dp_cp_group if getattr(param, "allreduce", True) else self.expt_dp_group
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    # ---- state is the wrapped module's -----------------------------------------------------------------------

    def state_dict(self, prefix: str = "", keep_vars: bool = False, **kwargs):
        self._finish_pending_param_gathers()
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars, **kwargs)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        self._finish_pending_param_gathers()
        if hasattr(self.module, "state_dict_for_save_checkpoint"):
            return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, *args, **kwargs):
        self._finish_pending_param_gathers()
        return self.module.sharded_state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the wrapped module in place (parameter storage stays inside the buffers)."""
        return self.module.load_state_dict(state_dict, strict=strict)
