"""Forward/backward schedules: no pipelining, 1F1B, and interleaved 1F1B with virtual pipeline stages.

All three share one contract (Megatron-Core's):

* ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)``. The model's input from the previous
  stage has already been handed over with ``model.set_input_tensor([tensor])``.
* On the last stage ``loss_func(output_tensor)`` returns ``(loss, num_tokens, reduced_dict)``, and the loss is
  divided by ``num_tokens`` and by ``num_microbatches`` unless ``config.calculate_per_token_loss`` (then it is
  left as a sum, and the token count of the whole step goes to ``config.finalize_model_grads_func``); or the legacy
  ``(loss, reduced_dict)``, divided by ``num_microbatches``. ``reduced_dict`` (e.g. ``{'lm loss': ...}``) is what
  the schedule returns, one per micro-batch, on the last stage; elsewhere the list is empty.
* ``config.grad_scale_func`` scales the loss before backward; ``config.no_sync_func`` suspends gradient reduction
  until the last micro-batch; ``config.grad_sync_func`` / ``config.param_sync_func`` launch a model chunk's
  gradient reduction / parameter gather overlapped with the pipeline; ``config.finalize_model_grads_func`` runs once
  after the last backward pass.

Schedules are keyword-only, as in Megatron: ``forward_step_func, data_iterator, model, num_microbatches,
seq_length, micro_batch_size, decoder_seq_length=None, forward_only=False, collect_non_loss_data=False,
first_val_step=None, adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
force_all_reduce=False``. ``forward_only`` runs the forward passes under ``torch.no_grad()``. ``pg_collection``
(tp, cp, pp, ...) and ``p2p_communicator`` default to the ``parallel_state`` groups; ``pg_collection`` and
``force_all_reduce`` are handed on to ``config.finalize_model_grads_func``.
"""

import contextlib
from typing import Callable, Iterator, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.interleaved_plan import InterleavedPlan, get_schedule_table  # noqa: F401
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

# The per-micro-batch steps live in schedule_steps; Megatron's public path to them is this module.
from megatron.core.pipeline_parallel.schedule_steps import (  # noqa: F401
    _ForwardPasses,
    backward_step,
    backward_step_multimodule,
    check_first_val_step,
    custom_backward,
    deallocate_output_tensor,
    forward_step,
    forward_step_calc_loss,
    get_model_config,
    get_tensor_device,
    get_tensor_shapes,
)
from megatron.core.process_groups_config import MultiModuleProcessGroupCollection, ProcessGroupCollection


def get_forward_backward_func(
    pp_size: Optional[int] = None,
    vp_size: Optional[int] = None,
    schedule_pg_collection: Optional[MultiModuleProcessGroupCollection] = None,
):
    """The schedule for this layout: no pipelining (one stage), 1F1B, or interleaved 1F1B (virtual stages).

    ``pp_size`` / ``vp_size`` default to the pipeline and virtual-pipeline sizes in ``parallel_state``.
    ``schedule_pg_collection`` (a ``MultiModuleProcessGroupCollection``, for pipelines of several modules such as
    a vision encoder feeding a language model) is not supported yet and must be None.
    """
    if schedule_pg_collection is not None:
        raise ValueError(
            "not supported yet: multi-module pipeline schedules "
            f"(schedule_pg_collection={type(schedule_pg_collection).__name__}); pass None"
        )
    if pp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if vp_size is None:
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size > 1:
        if vp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def get_pp_rank_microbatches(
    num_microbatches,
    num_model_chunks,
    microbatch_group_size_per_vp_stage,
    forward_only=False,
    overlap_moe_expert_parallel_comm=False,
    p2p_communicator: Optional[P2PCommunicator] = None,
):
    """How this pipeline rank splits its passes: ``(total, all_in_warmup, num_warmup, num_remaining)``.

    ``total`` is ``num_microbatches * num_model_chunks`` forward passes. Warm-up (forward passes before the first
    backward) is everything when ``forward_only``; with pipelining it is ``p - r - 1`` for 1F1B and
    ``2 (p - r - 1) + (v - 1) g`` for the interleaved schedule (``g`` = ``microbatch_group_size_per_vp_stage``),
    plus one when MoE expert-parallel communication is overlapped with the next micro-batch; without pipelining
    none. Warm-up is capped at ``total`` (then ``all_in_warmup``). The pipeline rank, size and
    virtual size come from ``p2p_communicator`` (default: ``parallel_state``).
    """
    if p2p_communicator is not None:
        pp_size, pp_rank = p2p_communicator.total_stages, p2p_communicator.current_stage
        vp_size = p2p_communicator.virtual_pipeline_model_parallel_size
    else:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    total = num_microbatches * num_model_chunks
    if forward_only:
        num_warmup = total
    elif pp_size > 1 and vp_size is None:
        # Stage r runs p-r-1 forwards before the first gradient can come back from the last stage.
        num_warmup = pp_size - pp_rank - 1
    elif pp_size > 1:
        num_warmup = 2 * (pp_size - pp_rank - 1) + (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
        num_warmup += int(bool(overlap_moe_expert_parallel_comm))
    else:
        num_warmup = 0
    all_in_warmup = num_warmup >= total
    num_warmup = min(num_warmup, total)
    return total, all_in_warmup, num_warmup, total - num_warmup


class _GradSyncSwitch:
    """Enters ``no_sync_func()`` to suspend gradient reduction and leaves it to let the reduction happen."""

    def __init__(self, no_sync_func):
        if isinstance(no_sync_func, (list, tuple)):
            chunk_funcs = list(no_sync_func)

            # One context that suspends reduction on every chunk (an ExitStack of the per-chunk contexts).
            def no_sync_func():
                stack = contextlib.ExitStack()
                for func in chunk_funcs:
                    stack.enter_context(func())
                return stack

        self.no_sync_func = no_sync_func or contextlib.nullcontext
        self.context = None

    def disable(self) -> None:
        if self.context is None:
            self.context = self.no_sync_func()
            # Entered and left by hand: the switch toggles between loop iterations, not around one block.
            self.context.__enter__()

    def enable(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None


def _single_chunk(model, data_iterator, schedule: str):
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(
                f"{schedule} takes one model chunk, got a list of {len(model)}; use the interleaved schedule "
                "(virtual_pipeline_model_parallel_size) for several chunks per rank"
            )
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            raise ValueError(f"{schedule} takes one data iterator, got a list of {len(data_iterator)}")
        data_iterator = data_iterator[0]
    return model, data_iterator


def _check_step(num_microbatches, config) -> None:
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        raise ValueError(
            "num_microbatches_with_partial_activation_checkpoints="
            f"{config.num_microbatches_with_partial_activation_checkpoints} is not supported; leave it None "
            "(recompute_granularity / recompute_num_layers apply to every micro-batch)"
        )
    if config.defer_embedding_wgrad_compute:
        raise ValueError(
            "defer_embedding_wgrad_compute=True needs deferred output-layer weight-gradient GEMMs, which are not "
            "available; set it to False"
        )


def _finalize(config, model_chunks: list, total_num_tokens, forward_only, pg_collection, force_all_reduce) -> None:
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            model_chunks,
            # Only per-token loss needs the step's token count; otherwise each loss was already divided.
            total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )


def _schedule_groups(pg_collection, p2p_communicator, config):
    """``(pg_collection, p2p_communicator)`` for a pipelined schedule: the arguments, else ``parallel_state``'s."""
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "pp"])
    if p2p_communicator is None:
        p2p_communicator = P2PCommunicator(pp_group=pg_collection.pp, config=config)
    return pg_collection, p2p_communicator


def _pipeline_position(pg_collection, p2p_communicator):
    """``(rank, size)`` of this pipeline stage; without explicit groups ``parallel_state``'s (0, 1 before it is
    initialised)."""
    if p2p_communicator is not None:
        return p2p_communicator.current_stage, p2p_communicator.total_stages
    if pg_collection is not None:
        return pg_collection.pp.rank(), pg_collection.pp.size()
    return parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()


def _cp_size(pg_collection) -> int:
    if pg_collection is None or pg_collection.cp is None:
        return parallel_state.get_context_parallel_world_size()
    return pg_collection.cp.size()


def _stage_tensor_shapes(config, groups, seq_length, micro_batch_size, decoder_seq_length):
    """:func:`get_tensor_shapes` for the groups a pipelined schedule runs with."""
    return get_tensor_shapes(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        config=config,
        tp_group=groups.tp,
        cp_group=groups.cp,
    )


def _no_shape_adjustment(adjust_tensor_shapes_fn, schedule: str) -> None:
    if adjust_tensor_shapes_fn is not None:
        raise ValueError(
            f"adjust_tensor_shapes_fn is not supported by {schedule} (only the non-interleaved pipeline schedule, "
            "forward_backward_pipelining_without_interleaving, exchanges tensors it can adjust); pass None"
        )


def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Optional[P2PCommunicator] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    force_all_reduce: Optional[bool] = False,
):
    """Run forward and backward for every micro-batch on a single stage; return the per-micro-batch loss dicts.

    Gradients accumulate across micro-batches; reduction is suspended (``no_sync_func``) for all but the last.
    ``seq_length``, ``micro_batch_size`` and ``p2p_communicator`` are unused here (nothing is communicated) but
    kept for the common signature.
    """
    del seq_length, micro_batch_size, decoder_seq_length, p2p_communicator
    _no_shape_adjustment(adjust_tensor_shapes_fn, "forward_backward_no_pipelining")
    model, data_iterator = _single_chunk(model, data_iterator, "forward_backward_no_pipelining")
    config = get_model_config(model)
    _check_step(num_microbatches, config)
    run_forward = _ForwardPasses(
        forward_step_func,
        num_microbatches,
        config,
        _cp_size(pg_collection),
        collect_non_loss_data,
        first_val_step,
        forward_only,
    )
    grad_sync = _GradSyncSwitch(config.no_sync_func)

    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for microbatch in range(num_microbatches):
            if microbatch < num_microbatches - 1:
                grad_sync.disable()
            else:
                grad_sync.enable()  # the last backward pass reduces the accumulated gradients
            output_tensor = run_forward(data_iterator, model, microbatch, None, is_last_stage=True)
            if not forward_only:
                backward_step(None, output_tensor, None, config)
    grad_sync.enable()
    _finalize(config, [model], run_forward.total_num_tokens, forward_only, pg_collection, force_all_reduce)
    return run_forward.forward_data_store


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Optional[P2PCommunicator] = None,
    pg_collection: Union[ProcessGroupCollection, MultiModuleProcessGroupCollection, None] = None,
    force_all_reduce: Optional[bool] = False,
):
    """The 1F1B schedule (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Stage ``r`` of ``p`` first runs ``min(p - r - 1, m)`` forward passes, then alternates a forward and a backward
    pass until its ``m`` forwards are done, then runs the remaining backward passes. At most ``p - r`` micro-batches
    are in flight on stage ``r``, so the first stage stashes activations for at most ``p`` micro-batches.

    ``adjust_tensor_shapes_fn(recv_tensor_shapes, send_tensor_shapes) -> (recv_tensor_shapes, send_tensor_shapes)``
    may change the shape of the tensor this stage receives and of the one it sends (e.g. a stage whose output
    width differs); each stays a list with one shape.
    """
    model, data_iterator = _single_chunk(model, data_iterator, "forward_backward_pipelining_without_interleaving")
    config = get_model_config(model)
    _check_step(num_microbatches, config)
    if config.overlap_p2p_comm:
        raise ValueError(
            "overlap_p2p_comm=True is only supported by the interleaved schedule; set it to False or use "
            "virtual_pipeline_model_parallel_size"
        )
    groups, p2p = _schedule_groups(pg_collection, p2p_communicator, config)
    first_stage, last_stage = p2p.is_pp_first_stage, p2p.is_pp_last_stage
    tensor_shapes = _stage_tensor_shapes(config, groups, seq_length, micro_batch_size, decoder_seq_length)
    # One tensor travels each way, so the communicator is given single shapes and answers with bare tensors.
    (recv_shape,), (send_shape,) = _adjusted_shapes(adjust_tensor_shapes_fn, tensor_shapes)
    if forward_only:
        num_warmup = num_microbatches
    else:
        num_warmup = min(p2p.total_stages - p2p.current_stage - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup

    grad_sync = _GradSyncSwitch(config.no_sync_func)
    # every backward but the last only accumulates
    grad_sync.disable()
    # With a custom grad_sync_func only the first stage reduces during its last backward pass; the others launch
    # their reduction after the flush, so every stage's reduction starts at about the same time.
    sync_in_last_backward = config.grad_sync_func is None or first_stage
    forward_passes = _ForwardPasses(
        forward_step_func,
        num_microbatches,
        config,
        _cp_size(groups),
        collect_non_loss_data,
        first_val_step,
        forward_only,
    )
    input_tensors, output_tensors = [], []

    def run_forward(microbatch: int, input_tensor):
        return forward_passes(data_iterator, model, microbatch, input_tensor, is_last_stage=last_stage)

    def run_backward(output_tensor_grad, is_last_backward: bool):
        if is_last_backward and sync_in_last_backward:
            grad_sync.enable()
        # FIFO: 1F1B runs backward passes in forward order
        input_tensor = input_tensors.pop(0)
        output_tensor = output_tensors.pop(0)
        return backward_step(input_tensor, output_tensor, output_tensor_grad, config)

    def stash(input_tensor, output_tensor) -> None:
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)
        if not last_stage:  # the last stage's output is its loss, which nothing else holds
            deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for microbatch in range(num_warmup):
            input_tensor = p2p.recv_forward(recv_shape, first_stage)
            output_tensor = run_forward(microbatch, input_tensor)
            p2p.send_forward(output_tensor, last_stage)
            if not forward_only:
                stash(input_tensor, output_tensor)

        input_tensor = None
        if num_steady > 0:
            # later inputs arrive with send_backward_recv_forward
            input_tensor = p2p.recv_forward(recv_shape, first_stage)
        for step in range(num_steady):
            last_step = step == num_steady - 1
            output_tensor = run_forward(num_warmup + step, input_tensor)
            if forward_only:
                p2p.send_forward(output_tensor, last_stage)
                if not last_step:
                    input_tensor = p2p.recv_forward(recv_shape, first_stage)
                continue
            output_tensor_grad = p2p.send_forward_recv_backward(output_tensor, send_shape, last_stage)
            stash(input_tensor, output_tensor)
            # Only the last overall backward reduces; with warm-up the cool-down loop ends later.
            input_tensor_grad = run_backward(output_tensor_grad, is_last_backward=last_step and num_warmup == 0)
            if last_step:
                p2p.send_backward(input_tensor_grad, first_stage)
            else:
                input_tensor = p2p.send_backward_recv_forward(input_tensor_grad, recv_shape, first_stage)

    if not forward_only:
        for step in range(num_warmup):
            output_tensor_grad = p2p.recv_backward(send_shape, last_stage)
            input_tensor_grad = run_backward(output_tensor_grad, is_last_backward=step == num_warmup - 1)
            p2p.send_backward(input_tensor_grad, first_stage)
    grad_sync.enable()
    if config.grad_sync_func is not None and not forward_only:
        config.grad_sync_func(model.parameters())
    _finalize(config, [model], forward_passes.total_num_tokens, forward_only, pg_collection, force_all_reduce)
    return forward_passes.forward_data_store


def _adjusted_shapes(adjust_tensor_shapes_fn, tensor_shapes):
    """``(recv_shapes, send_shapes)``: the stage's shapes, changed by ``adjust_tensor_shapes_fn`` if given."""
    recv_shapes, send_shapes = list(tensor_shapes), list(tensor_shapes)
    if adjust_tensor_shapes_fn is None:
        return recv_shapes, send_shapes
    recv_shapes, send_shapes = adjust_tensor_shapes_fn(recv_shapes, send_shapes)
    for what, shapes in (("receive", recv_shapes), ("send", send_shapes)):
        if not isinstance(shapes, (list, tuple)) or len(shapes) != 1:
            raise ValueError(
                f"adjust_tensor_shapes_fn must return one {what} shape per stage in a list (a stage exchanges one "
                f"tensor), got {shapes!r}"
            )
    return list(recv_shapes), list(send_shapes)


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Optional[P2PCommunicator] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    force_all_reduce: Optional[bool] = False,
):
    """Interleaved 1F1B: each rank holds ``v`` model chunks (virtual stages) and the pipeline bubble shrinks by ``v``.

    ``model`` and ``data_iterator`` are lists with one entry per chunk. Chunk ``c`` of pipeline rank ``r`` is virtual
    stage ``c * p + r``. Forward passes follow :func:`get_schedule_table`; backward passes follow the same table with
    chunks mirrored. See :class:`~megatron.core.pipeline_parallel.interleaved_plan.InterleavedPlan` for the order of
    work and communication on each rank.
    """
    if not isinstance(model, list) or not all(isinstance(chunk, torch.nn.Module) for chunk in model):
        raise TypeError("the interleaved schedule expects model to be a list of model chunks (torch.nn.Module)")
    if not isinstance(data_iterator, list) or len(data_iterator) != len(model):
        raise TypeError(
            "the interleaved schedule expects data_iterator to be a list with one iterator (or None) per model chunk"
        )
    _no_shape_adjustment(adjust_tensor_shapes_fn, "the interleaved schedule")
    config = get_model_config(model[0])
    _check_step(num_microbatches, config)
    if config.overlap_p2p_comm and config.batch_p2p_comm:
        raise ValueError(
            "overlap_p2p_comm=True and batch_p2p_comm=True cannot be combined (Megatron-LM turns batching off when "
            "overlapping); set batch_p2p_comm=False"
        )
    pp_rank, pp_size = _pipeline_position(pg_collection, p2p_communicator)
    plan = InterleavedPlan(  # validates the layout before any group is needed
        num_microbatches=num_microbatches,
        num_model_chunks=len(model),
        microbatch_group_size=config.microbatch_group_size_per_vp_stage,
        pp_rank=pp_rank,
        pp_size=pp_size,
        vp_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        forward_only=forward_only,
    )
    groups, p2p = _schedule_groups(pg_collection, p2p_communicator, config)
    (tensor_shape,) = _stage_tensor_shapes(config, groups, seq_length, micro_batch_size, decoder_seq_length)
    forward_passes = _ForwardPasses(
        forward_step_func,
        num_microbatches,
        config,
        _cp_size(groups),
        collect_non_loss_data,
        first_val_step,
        forward_only,
    )
    runner = _InterleavedRunner(plan, forward_passes, data_iterator, model, config, p2p, tensor_shape)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        runner.run()
    _finalize(config, model, forward_passes.total_num_tokens, forward_only, pg_collection, force_all_reduce)
    return forward_passes.forward_data_store


class _InterleavedRunner:
    """Carries out an :class:`InterleavedPlan` on this rank: compute, communicate, buffer, sync gradients."""

    def __init__(self, plan, forward_passes, data_iterators, model, config, p2p_communicator, tensor_shape):
        self.plan = plan
        self.forward_passes = forward_passes
        self.data_iterators = data_iterators
        self.model = model
        self.config = config
        self.p2p = p2p_communicator
        self.tensor_shape = tensor_shape
        # Tensors keyed by (microbatch_id, model_chunk_id): inputs received ahead of their forward pass, gradients
        # received ahead of their backward pass, and what a forward pass leaves for its backward pass.
        self.inputs = {}
        self.output_grads = {}
        self.stashed = {}
        self.grad_sync = _GradSyncSwitch(config.no_sync_func)
        self.synchronized_chunks = set()
        self.grad_sync_funcs = self._per_chunk(config.grad_sync_func)
        self.param_sync_funcs = self._per_chunk(config.param_sync_func)
        # Calls posted but not yet waited on (only with overlap_p2p_comm): (requests, sent activation) or None.
        self.pending_activations = None
        self.pending_gradients = None

    def _per_chunk(self, func):
        if func is None or self.plan.forward_only:  # forward-only steps neither reduce gradients nor gather params
            return None
        return list(func) if isinstance(func, (list, tuple)) else [func] * len(self.model)

    def run(self) -> None:
        plan, config = self.plan, self.config
        self.grad_sync.disable()
        if self.param_sync_funcs is not None:
            # The first two chunks are gathered up front; _launch_param_sync prefetches each later one in time.
            for chunk in range(min(2, plan.num_model_chunks)):
                self.param_sync_funcs[chunk](self.model[chunk].parameters())
        first_key = plan.forward_key(0)
        if not plan.is_first_virtual_stage(first_key[1]):
            # No earlier slot posted this receive, so fetch the first input before the loop.
            self.inputs[first_key] = self.p2p.recv_forward(self.tensor_shape, is_first_stage=False)

        for slot in range(plan.num_slots):
            self._wait_activations()  # the forward pass may need what it brought; its sent tensor may be freed
            output_tensor = None
            if plan.has_forward(slot):
                output_tensor = self._forward(slot)
                if plan.is_last_virtual_stage(plan.forward_key(slot)[1]):
                    output_tensor = None  # the loss stays here
            recv_prev_key = plan.activation_to_receive(slot)
            if config.overlap_p2p_comm:
                # Activations travel while this slot's backward pass computes.
                self.pending_activations = self._post(output_tensor, None, recv_prev_key, None)
            self._wait_gradients()
            input_tensor_grad = None
            if plan.has_backward(slot):
                input_tensor_grad = self._backward(slot - plan.num_warmup)
                if plan.is_first_virtual_stage(plan.backward_key(slot - plan.num_warmup)[1]):
                    input_tensor_grad = None  # nothing before the first stage
            recv_next_key = plan.gradient_to_receive(slot)
            if config.overlap_p2p_comm:
                # Gradients travel while the next slot's forward pass computes.
                self.pending_gradients = self._post(None, input_tensor_grad, None, recv_next_key)
            else:
                self.pending_activations = self._post(output_tensor, input_tensor_grad, recv_prev_key, recv_next_key)
                # Without overlap each exchange completes before the next slot.
                self._wait_activations()
        self._wait_activations()
        self._wait_gradients()

        self.grad_sync.enable()
        if self.grad_sync_funcs is not None:
            for chunk in range(plan.num_model_chunks):
                if chunk not in self.synchronized_chunks:
                    self.grad_sync_funcs[chunk](self.model[chunk].parameters())
        if self.inputs or self.output_grads or self.stashed:
            raise RuntimeError(
                "the interleaved schedule ended with tensors it never used "
                f"(inputs {sorted(self.inputs)}, gradients {sorted(self.output_grads)}, stashed {sorted(self.stashed)})"
            )

    def _post(self, send_next, send_prev, recv_prev_key, recv_next_key):
        """Post one call without waiting; return what finishing it needs: (requests, sent activation) or None."""
        if all(x is None for x in (send_next, send_prev, recv_prev_key, recv_next_key)):
            return None
        received_input, received_grad, requests = self.p2p._communicate(
            tensor_send_next=send_next,
            tensor_send_prev=send_prev,
            recv_prev=recv_prev_key is not None,
            recv_next=recv_next_key is not None,
            tensor_shape=self.tensor_shape,
            wait_on_reqs=False,
        )
        if recv_prev_key is not None:
            self.inputs[recv_prev_key] = received_input
        if recv_next_key is not None:
            self.output_grads[recv_next_key] = received_grad
        return requests, send_next

    def _wait_activations(self) -> None:
        self._finish(self.pending_activations)
        self.pending_activations = None

    def _wait_gradients(self) -> None:
        self._finish(self.pending_gradients)
        self.pending_gradients = None

    def _finish(self, pending) -> None:
        """Wait for a posted call; only then may the sent activation's memory be released."""
        if pending is None:
            return
        requests, sent_activation = pending
        for request in requests:
            request.wait()
        if sent_activation is not None and not self.plan.forward_only:
            deallocate_output_tensor(sent_activation, self.config.deallocate_pipeline_outputs)

    def _forward(self, virtual_id: int):
        plan = self.plan
        microbatch, chunk = plan.forward_key(virtual_id)
        # parallel_state's first/last-stage queries inside the model then answer for this chunk.
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        self._launch_param_sync(virtual_id)
        if plan.is_first_virtual_stage(chunk):
            input_tensor = None
        else:
            input_tensor = self.inputs.pop((microbatch, chunk))
        output_tensor = self.forward_passes(
            self.data_iterators[chunk],
            self.model[chunk],
            microbatch,
            input_tensor,
            is_last_stage=plan.is_last_virtual_stage(chunk),
            vp_stage=chunk,
        )
        if not plan.forward_only:
            self.stashed[(microbatch, chunk)] = (input_tensor, output_tensor)
        return output_tensor

    def _backward(self, backward_id: int):
        plan = self.plan
        microbatch, chunk = plan.backward_key(backward_id)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        last_for_chunk = microbatch == plan.num_microbatches - 1
        if self.grad_sync_funcs is None and last_for_chunk:
            self.grad_sync.enable()  # this backward pass reduces the chunk's accumulated gradients
            self.synchronized_chunks.add(chunk)
        input_tensor, output_tensor = self.stashed.pop((microbatch, chunk))
        output_grad = None if plan.is_last_virtual_stage(chunk) else self.output_grads.pop((microbatch, chunk))
        input_tensor_grad = backward_step(input_tensor, output_tensor, output_grad, self.config)
        self._launch_grad_sync(backward_id)
        # The next backward pass, of whichever chunk, only accumulates again.
        self.grad_sync.disable()
        return input_tensor_grad

    def _launch_param_sync(self, virtual_id: int) -> None:
        """Gather the parameters of the chunk after next ahead of its first forward pass.

        Ranks launch it at the same virtual step (offset by their pipeline rank), so the gathers line up.
        """
        if self.param_sync_funcs is None:
            return
        plan = self.plan
        sync_id = virtual_id + plan.pp_rank
        if sync_id < plan.total and plan.forward_key(sync_id)[0] == 0:
            chunk = plan.forward_key(sync_id)[1] + 1
            # Chunks 0 and 1 were gathered in run() before the first slot.
            if 1 < chunk < plan.num_model_chunks:
                self.param_sync_funcs[chunk](self.model[chunk].parameters())

    def _launch_grad_sync(self, backward_id: int) -> None:
        """Launch a chunk's gradient reduction once its last backward pass is done on every rank's clock."""
        if self.grad_sync_funcs is None:
            return
        plan = self.plan
        sync_id = backward_id - plan.pp_rank
        if sync_id >= 0 and plan.backward_key(sync_id)[0] == plan.num_microbatches - 1:
            chunk = plan.backward_key(sync_id)[1]
            self.grad_sync.enable()
            self.grad_sync_funcs[chunk](self.model[chunk].parameters())
            self.synchronized_chunks.add(chunk)
