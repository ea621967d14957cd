"""The training loop: pretrain() -> model and optimizer -> data -> train() with logging, evaluation and checkpoints.

Read top to bottom it is the life of a job: `pretrain` initialises, builds the model chunks of this pipeline rank
(`get_model`), the optimizer and LR scheduler, resumes from `--load`, builds the data iterators, then `train` runs
`train_step` until an exit condition, evaluating and saving on the configured intervals.
"""

import argparse
import copy
import gc
import logging
import math
import sys
from datetime import datetime
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core import mpu, parallel_state  # noqa: F401  (mpu: Megatron's name in this module, patched by tests)
from megatron.core.distributed import finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.process_groups_config import MultiModuleProcessGroupCollection, ProcessGroupCollection
from megatron.core.utils import get_current_device, get_pg_rank, get_pg_size  # noqa: F401  (as mpu above)
from megatron.training import checkpointing
from megatron.training import progress_log
from megatron.training.error_handling import exit_on_error
from megatron.training.global_vars import (
    destroy_global_vars,
    get_args,
    get_signal_handler,
    get_tensorboard_writer,
    get_timers,
    get_wandb_writer,
    set_args,
)
from megatron.training.initialize import initialize_megatron

# The job's setup and its clock live in model_setup and progress_log; Megatron-LM's path re-exports them.
from megatron.training.model_setup import (  # noqa: F401
    arguments_from_container,
    build_train_valid_test_data_iterators,
    build_train_valid_test_data_loaders,
    build_train_valid_test_datasets,
    cyclic_iter,
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    force_param_sync,
    get_megatron_ddp_config,
    get_megatron_optimizer_config,
    get_model,
    get_optimizer_param_scheduler,
    get_train_valid_test_num_samples,
    resolve_ddp_bucket_size,
    setup_model_and_optimizer,
    should_disable_forward_pre_hook,
    update_train_iters,
    wrap_model_chunks_with_ddp,
)
from megatron.training.moe_logging import track_moe_losses
from megatron.training.progress_log import (  # noqa: F401
    compute_throughputs_and_append_to_progress_log,
    get_start_time_from_progress_log,
    consume_seqlen_stats_in_iteration,
    num_floating_point_operations,
    set_startup_timestamps,
    update_seqlen_stats_from_cu_seqlens,
)
from megatron.training.utils import (
    append_to_progress_log,
    calc_params_l2_norm,
    is_last_rank,
    print_rank_0,
    print_rank_last,
    report_memory,
    unwrap_model,
)

logger = logging.getLogger(__name__)


def print_datetime(string, override_timestamp=None):
    """``[string] datetime: <now, or override_timestamp>`` on rank 0, after a barrier."""
    if dist.is_initialized():
        dist.barrier()
    moment = datetime.now() if override_timestamp is None else datetime.fromtimestamp(override_timestamp)
    print_rank_0(f"[{string}] datetime: {moment.strftime('%Y-%m-%d %H:%M:%S')} ")


def _flush_log_writers() -> None:
    """Keep what the writers buffered (TensorBoard events) when a failing rank exits without interpreter shutdown."""
    writer = get_tensorboard_writer()
    if writer is not None:
        writer.flush()


@exit_on_error(before_exit=_flush_log_writers)
def pretrain(
    cfg_container,
    train_valid_test_dataset_provider,
    model_type,
    forward_step_func,
    model_provider=None,
    process_non_loss_data_func=None,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    store=None,
    inprocess_call_wrapper: Optional[Any] = None,
    p2p_communicator: Optional[P2PCommunicator] = None,
    pg_collection: Union[ProcessGroupCollection, MultiModuleProcessGroupCollection, None] = None,
    skip_model_parallel_init=False,
):
    """Megatron-LM's entry point: initialise, build everything, train, evaluate, save.

    ``cfg_container`` is the validated arguments (``parse_and_validate_args()``) or None for those already set.
    ``process_non_loss_data_func(collected, iteration, writer)`` receives what the forward step returns for
    non-loss data during evaluation; ``non_loss_data_func(model)`` computes such data directly. ``store``,
    ``get_embedding_ranks``, ``get_position_embedding_ranks`` and ``skip_model_parallel_init`` go to
    ``initialize_megatron``; ``p2p_communicator`` and ``pg_collection`` to the schedules (and ``pg_collection`` to
    the model provider and DDP).
    """
    args = arguments_from_container(cfg_container)
    if model_provider is None:
        raise ValueError(
            "not supported yet: building the model from Megatron's configuration container (model_provider=None); "
            "pass model_provider (a function of pre_process, post_process and vp_stage returning the model chunk)"
        )
    if inprocess_call_wrapper is not None:
        raise ValueError(
            "not supported yet: in-process restart (inprocess_call_wrapper, from NVIDIA Resiliency "
            "Extension); pass None"
        )
    if args is not None:
        set_args(args)
    initialize_megatron(
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        store=store,
        skip_model_parallel_init=skip_model_parallel_init,
    )
    args = get_args()
    print_rank_0(f"time to initialize megatron (seconds): {progress_log.seconds_since_start():.3f}")
    if getattr(args, "log_progress", False):
        append_to_progress_log(args.save, "Starting job")
    if getattr(args, "dry_run", False):
        _print_dry_run_report(args)
        return

    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(
        model_type, model_provider, checkpointing_context={}, pg_collection=pg_collection
    )
    config = unwrap_model(model[0]).config
    train_iterator, valid_iterator, test_iterator = build_train_valid_test_data_iterators(
        train_valid_test_dataset_provider
    )
    if len(model) > 1:
        # The interleaved schedule takes one iterator per model chunk. Only the first stage's first chunk and the
        # last stage's last chunk read batches, never both on one rank (it needs PP > 1), so they share this one.
        train_iterator, valid_iterator, test_iterator = (
            [iterator] * len(model) for iterator in (train_iterator, valid_iterator, test_iterator)
        )
    iteration = args.iteration
    checkpointing_context = {}
    eval_kwargs = dict(
        non_loss_data_func=non_loss_data_func, pg_collection=pg_collection, p2p_communicator=p2p_communicator
    )
    if not args.skip_train and args.train_iters > 0:
        iteration, _ = train(
            forward_step_func,
            model,
            optimizer,
            opt_param_scheduler,
            train_iterator,
            valid_iterator,
            process_non_loss_data_func,
            config,
            checkpointing_context,
            non_loss_data_func,
            p2p_communicator=p2p_communicator,
            pg_collection=pg_collection,
        )
        if args.save and iteration != 0 and iteration % args.save_interval != 0:  # on the interval, train() just saved
            save_checkpoint_and_time(
                iteration,
                model,
                optimizer,
                opt_param_scheduler,
                args.num_floating_point_operations_so_far,
                checkpointing_context,
                train_data_iterator=train_iterator,
            )
    if args.do_valid and args.eval_iters > 0:
        evaluate_and_print_results(
            f"iteration {iteration} on validation set",
            forward_step_func,
            valid_iterator,
            model,
            iteration,
            process_non_loss_data_func,
            config,
            verbose=True,
            **eval_kwargs,
        )
    if args.do_test and args.eval_iters > 0:
        evaluate_and_print_results(
            f"iteration {iteration} on test set",
            forward_step_func,
            test_iterator,
            model,
            iteration,
            process_non_loss_data_func,
            config,
            verbose=True,
            **eval_kwargs,
        )
    checkpointing.finalize_async_saves()  # no async save may still be writing at exit


def destroy_global_state():
    """Forget everything a run set up (globals, micro-batch calculator, process groups, rerun state machine), so a
    second run can start in the same process."""
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    destroy_global_vars()  # the micro-batch calculator too
    parallel_state.destroy_global_memory_buffer()
    parallel_state.destroy_model_parallel()
    destroy_rerun_state_machine()


# ---- one step --------------------------------------------------------------------------------------------------


def train_step(
    forward_step_func,
    data_iterator,
    model,
    optimizer,
    opt_param_scheduler,
    config,
    forward_backward_func,
    iteration=None,
    pg_collection: Union[ProcessGroupCollection, MultiModuleProcessGroupCollection, None] = None,
    p2p_communicator: Optional[P2PCommunicator] = None,
):
    """Forward/backward over the global batch's micro-batches, optimizer step, scheduler step, reduced losses.

    ``forward_backward_func`` is the schedule (``get_forward_backward_func()``); ``iteration``, the iterations done
    before this one, names this step in DDP's NaN reports; ``pg_collection`` and ``p2p_communicator`` go to the
    schedule. Returns (reduced losses, skipped (0/1), grad norm, number of zeros in the gradients).
    """
    args = get_args()
    for chunk in model:
        chunk.zero_grad_buffer()  # main_grad accumulates over micro-batches
        if iteration is not None:
            chunk.iteration = iteration + 1
    optimizer.zero_grad()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=get_num_microbatches(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=None,
        forward_only=False,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
    )
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    if update_successful:  # a skipped step must not advance the LR schedule
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
    skipped_iter = 0 if update_successful else 1
    loss_reduced = _reduce_losses_over_data_parallel(losses_reduced)
    return loss_reduced, skipped_iter, grad_norm, num_zeros_in_grad


def _reduce_losses_over_data_parallel(losses_reduced: List[Dict]) -> Dict[str, torch.Tensor]:
    """Average each reported loss over micro-batches and data-parallel ranks (on the last pipeline stage).

    A value is either ``[sum, count]`` (the token-weighted form, summed then divided) or a plain per-micro-batch mean.
    """
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) or not losses_reduced:
        return {}
    reduced = {}
    for key in losses_reduced[0]:
        values = [torch.as_tensor(step[key], device=get_current_device()).float().view(-1) for step in losses_reduced]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0)
            # Numerators and token counts are summed first, so every token weighs the same across ranks.
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            reduced[key] = total[0] / total[1].clamp_min(1)
        else:
            mean = torch.stack(values).mean().view(1)  # SUM over DP then divide: gloo has no AVG reduction
            dist.all_reduce(mean, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            reduced[key] = mean[0] / parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return reduced


# ---- the loop --------------------------------------------------------------------------------------------------


def _configure_hooks(config, model, optimizer) -> None:
    args = get_args()
    if args.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if args.align_grad_reduce:  # the schedule launches the reductions itself
            grad_sync = [chunk.start_grad_sync for chunk in model]
            config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    if args.overlap_param_gather and args.align_param_gather:
        param_sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss  # losses are multiplied by the (fp16) loss scale
    config.timers = None


def train(
    forward_step_func,
    model,
    optimizer,
    opt_param_scheduler,
    train_data_iterator,
    valid_data_iterator,
    process_non_loss_data_func,
    config,
    checkpointing_context,
    non_loss_data_func,
    inference_model=None,
    p2p_communicator: Optional[P2PCommunicator] = None,
    pg_collection: Union[ProcessGroupCollection, MultiModuleProcessGroupCollection, None] = None,
):
    """Run train_step until --train-iters (or an exit condition); returns (iteration, flops so far).

    ``checkpointing_context`` is handed to every save; ``process_non_loss_data_func``, ``non_loss_data_func``,
    ``p2p_communicator`` and ``pg_collection`` to the evaluations (the last two to every step too).
    """
    if inference_model is not None:
        raise ValueError(
            "not supported yet: a separate inference model during training (inference_model, for "
            "reinforcement learning); pass None"
        )
    args = get_args()
    timers = get_timers()
    forward_backward_func = get_forward_backward_func()
    _configure_hooks(config, model, optimizer)
    for chunk in model:
        chunk.train()
    iteration = args.iteration
    total_loss_dict: Dict[str, torch.Tensor] = {}
    report_memory_flag = True
    timers("interval-time", log_level=0).start(barrier=True)
    print_rank_0(f"[before the start of training step] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}")
    while iteration < args.train_iters:
        update_num_microbatches(args.consumed_train_samples, consistency_check=True)  # batch-size ramp-up
        loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = train_step(
            forward_step_func,
            train_data_iterator,
            model,
            optimizer,
            opt_param_scheduler,
            config,
            forward_backward_func,
            iteration,
            pg_collection=pg_collection,
            p2p_communicator=p2p_communicator,
        )
        iteration += 1
        args.iteration = iteration
        batch_size = parallel_state.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
        args.consumed_train_samples += batch_size
        total_real_tokens, seqlen_squared_sum = consume_seqlen_stats_in_iteration()
        args.num_floating_point_operations_so_far += num_floating_point_operations(
            args, batch_size, seqlen_squared_sum, total_real_tokens
        )
        params_norm = None
        if args.log_params_norm and iteration % args.log_interval == 0:  # a host sync: only when it is printed
            params_norm = calc_params_l2_norm(model)
        report_memory_flag = training_log(
            loss_dict,
            total_loss_dict,
            optimizer.param_groups[0]["lr"],
            iteration,
            float(optimizer.get_loss_scale()),
            report_memory_flag,
            skipped_iter,
            grad_norm,
            params_norm,
            num_zeros_in_grad,
            None,
            pg_collection=pg_collection,
            seqlen_squared_sum_in_batch=seqlen_squared_sum,
            total_real_tokens_in_batch=total_real_tokens,
        )
        if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
            evaluate_and_print_results(
                f"iteration {iteration}",
                forward_step_func,
                valid_data_iterator,
                model,
                iteration,
                process_non_loss_data_func,
                config,
                verbose=False,
                non_loss_data_func=non_loss_data_func,
                pg_collection=pg_collection,
                p2p_communicator=p2p_communicator,
            )
        checkpointing.maybe_finalize_async_saves()  # collective: every rank calls it each iteration
        if checkpoint_and_decide_exit(
            model,
            optimizer,
            opt_param_scheduler,
            iteration,
            args.num_floating_point_operations_so_far,
            checkpointing_context,
            train_data_iterator,
        ):
            # As in Megatron-LM, an exit condition ends the job here, once its checkpoint is written: no second
            # end-of-training save and no final evaluation eat into a scheduler's grace period.
            checkpointing.finalize_async_saves()
            sys.exit(0)
    return iteration, args.num_floating_point_operations_so_far


def checkpoint_and_decide_exit(
    model,
    optimizer,
    opt_param_scheduler,
    iteration,
    num_floating_point_operations_so_far,
    checkpointing_context,
    train_data_iterator,
):
    """Save on the interval; decide to stop (after saving, once) on a signal, --exit-interval or
    --exit-duration-in-mins. Returns whether the job should exit now."""
    args = get_args()
    saved_on_interval = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
    if saved_on_interval:
        save_checkpoint_and_time(
            iteration,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
            checkpointing_context,
            train_data_iterator=train_data_iterator,
        )
    reason = _exit_reason(iteration, get_signal_handler())
    if reason is None:
        return False
    if args.save and not saved_on_interval:
        save_checkpoint_and_time(
            iteration,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
            checkpointing_context,
            train_data_iterator=train_data_iterator,
        )
    print_rank_last(f"exiting program {reason}")
    return True


def save_checkpoint_and_time(
    iteration,
    model,
    optimizer,
    opt_param_scheduler,
    num_floating_point_operations_so_far,
    checkpointing_context,
    non_persistent_ckpt=False,
    train_data_iterator=None,
):
    """save_checkpoint under the ``save-checkpoint`` timer (logged), then, with --log-progress, the throughput
    line of the progress log."""
    args = get_args()
    timers = get_timers()
    timers("save-checkpoint", log_level=0).start(barrier=True)
    checkpointing.save_checkpoint(
        iteration,
        model,
        optimizer,
        opt_param_scheduler,
        num_floating_point_operations_so_far,
        checkpointing_context,
        non_persistent_ckpt=non_persistent_ckpt,
        train_data_iterator=train_data_iterator,
        preprocess_common_state_dict_fn=preprocess_common_state_dict,
    )
    timers("save-checkpoint").stop(barrier=True)
    timers.log(["save-checkpoint"])
    if getattr(args, "log_progress", False):
        progress_log.compute_throughputs_and_append_to_progress_log(iteration, num_floating_point_operations_so_far)


def preprocess_common_state_dict(common_state_dict):
    """The common state as compared across ranks before a save: the arguments as a dict without ``rank`` and
    ``local_rank`` (which legitimately differ); the saved state itself is left as it is."""
    preprocessed = copy.copy(common_state_dict)
    if isinstance(preprocessed.get("args"), argparse.Namespace):
        preprocessed["args"] = {
            key: value for key, value in vars(preprocessed["args"]).items() if key not in ("rank", "local_rank")
        }
    return preprocessed


def _exit_reason(iteration, signal_handler) -> Optional[str]:
    """Why the job should stop after this iteration, or None (every check is the same on every rank)."""
    args = get_args()
    if signal_handler is not None and any(signal_handler.signals_received()):
        return f"after receiving a termination signal at iteration {iteration}"
    if args.exit_duration_in_mins:
        elapsed_mins = torch.tensor([(progress_log.seconds_since_start()) / 60.0], device=get_current_device())
        dist.all_reduce(elapsed_mins, op=dist.ReduceOp.MAX)  # clocks differ; all ranks must decide alike
        if elapsed_mins.item() > args.exit_duration_in_mins:
            return f"after {elapsed_mins.item():.1f} minutes"
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"at iteration {iteration}"
    return None


# ---- logging ---------------------------------------------------------------------------------------------------


_SKIPPED, _NAN, _ADVANCED = "skipped iterations", "nan iterations", "advanced iterations"


def training_log(
    loss_dict,
    total_loss_dict,
    learning_rate: float | None,
    iteration,
    loss_scale,
    report_memory_flag,
    skipped_iter,
    grad_norm,
    params_norm,
    num_zeros_in_grad,
    max_attention_logit,
    pg_collection=None,
    is_first_iteration=False,
    seqlen_squared_sum_in_batch: float | None = None,
    total_real_tokens_in_batch: float | None = None,
):
    """Accumulate losses and print Megatron-LM's log line every --log-interval iterations (from the last rank).

    ``params_norm`` and ``max_attention_logit`` are printed when given; ``pg_collection`` supplies the
    data-parallel group that sets the batch size; the packed-sequence statistics make the throughput exact;
    ``is_first_iteration`` forces the line (and the memory report) right after the first step.
    Returns the new ``report_memory_flag``.
    """
    args = get_args()
    dp_group = pg_collection.dp if pg_collection is not None else parallel_state.get_data_parallel_group()
    batch_size = dist.get_world_size(dp_group) * args.micro_batch_size * get_num_microbatches()
    timers = get_timers()
    writer = get_tensorboard_writer()
    wandb_writer = get_wandb_writer()

    total_loss_dict[_ADVANCED] = total_loss_dict.get(_ADVANCED, 0) + (1 - skipped_iter)
    total_loss_dict[_SKIPPED] = total_loss_dict.get(_SKIPPED, 0) + skipped_iter
    got_nan = False
    for key, value in loss_dict.items():
        if not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, torch.zeros_like(value)) + value
        got_nan = got_nan or not math.isfinite(float(value))
    total_loss_dict[_NAN] = total_loss_dict.get(_NAN, 0) + int(got_nan)

    if writer is not None and iteration % args.tensorboard_log_interval == 0:
        writer.add_scalar("learning-rate", learning_rate, iteration)
        writer.add_scalar("batch-size", batch_size, iteration)
        for key, value in loss_dict.items():
            writer.add_scalar(key, float(value), iteration)
        writer.add_scalar("loss-scale", loss_scale, iteration)
        if grad_norm is not None:
            writer.add_scalar("grad-norm", grad_norm, iteration)
    if wandb_writer is not None and iteration % args.tensorboard_log_interval == 0:
        wandb_writer.log({"learning-rate": learning_rate, **{k: float(v) for k, v in loss_dict.items()}}, iteration)

    track_moe_losses(args, iteration, writer, wandb_writer, total_loss_dict)

    if iteration % args.log_interval != 0 and not is_first_iteration:
        return report_memory_flag
    elapsed_time = timers("interval-time").elapsed(barrier=True)
    elapsed_per_iteration = elapsed_time / (1 if is_first_iteration else args.log_interval)
    iteration_flops = num_floating_point_operations(
        args, batch_size, seqlen_squared_sum_in_batch, total_real_tokens_in_batch
    )
    throughput = iteration_flops / (elapsed_per_iteration * 1e12 * args.world_size)
    log_string = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    log_string += " iteration {:8d}/{:8d} |".format(iteration, args.train_iters)
    log_string += " consumed samples: {:12d} |".format(args.consumed_train_samples)
    log_string += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_per_iteration * 1000.0)
    if args.log_throughput:
        log_string += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
        if writer is not None:
            writer.add_scalar("throughput", throughput, iteration)
    log_string += f" learning rate: {learning_rate:.6E} |"
    log_string += " global batch size: {:5d} |".format(batch_size)
    advanced = max(1, total_loss_dict[_ADVANCED])
    for key in list(total_loss_dict):
        if key in (_ADVANCED, _SKIPPED, _NAN):
            continue
        average = float(total_loss_dict[key]) / advanced
        if average > 0.0:
            log_string += " {}: {:.6E} |".format(key, average)
        total_loss_dict[key] = torch.zeros_like(total_loss_dict[key])
    log_string += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        log_string += f" grad norm: {grad_norm:.3f} |"
    if num_zeros_in_grad is not None:
        log_string += f" num zeros: {num_zeros_in_grad:.1f} |"
    if params_norm is not None:
        log_string += f" params norm: {params_norm:.3f} |"
    if max_attention_logit is not None:
        log_string += f" max attention logit: {max_attention_logit:.3f} |"
    log_string += " number of skipped iterations: {:3d} |".format(total_loss_dict[_SKIPPED])
    log_string += " number of nan iterations: {:3d} |".format(total_loss_dict[_NAN])
    total_loss_dict[_ADVANCED] = total_loss_dict[_SKIPPED] = total_loss_dict[_NAN] = 0
    print_rank_last(log_string)
    if report_memory_flag:
        report_memory(f"iteration {iteration}")  # printed by data-parallel rank 0 of every model-parallel rank
        report_memory_flag = False
    return report_memory_flag


# ---- evaluation ------------------------------------------------------------------------------------------------


def evaluate(
    forward_step_func,
    data_iterator,
    model,
    process_non_loss_data_func,
    config,
    verbose=False,
    non_loss_data_func=None,
    eval_iters=None,
    pg_collection=None,
    p2p_communicator=None,
):
    """Average loss over ``eval_iters`` (default --eval-iters) global batches, without gradients.

    Returns (loss dict, collected non-loss data, time limit hit): with ``process_non_loss_data_func`` one more
    forward pass collects what the loss function returns for ``non_loss_data=True`` (on the last rank), or
    ``non_loss_data_func(model)`` computes it; with --exit-duration-in-mins the evaluation stops early when the
    job's time is up.
    """
    args = get_args()
    eval_iters = args.eval_iters if eval_iters is None else eval_iters
    forward_backward_func = get_forward_backward_func()
    schedule_kwargs = dict(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=None,
        forward_only=True,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
    )
    for chunk in model:
        chunk.eval()
    totals: Dict[str, torch.Tensor] = {}
    steps_done, timelimit_hit, collected_non_loss_data = 0, False, None
    with torch.no_grad():
        for step in range(eval_iters):
            if verbose:
                print_rank_last(f"Evaluating iter {step + 1}/{eval_iters}")
            losses = forward_backward_func(**schedule_kwargs)
            for key, value in _reduce_losses_over_data_parallel(losses).items():
                totals[key] = totals.get(key, 0) + value
            args.consumed_valid_samples += args.global_batch_size
            steps_done += 1
            if args.exit_duration_in_mins and _elapsed_minutes() > args.exit_duration_in_mins:
                print_rank_0(f"Exiting during evaluation, timelimit reached after {steps_done} iterations")
                timelimit_hit = True
                break
        if not timelimit_hit:
            if non_loss_data_func is not None:
                collected_non_loss_data = non_loss_data_func(model)
            elif process_non_loss_data_func is not None and is_last_rank():
                collected_non_loss_data = forward_backward_func(**schedule_kwargs, collect_non_loss_data=True)
    for chunk in model:
        chunk.train()
    return {key: value / steps_done for key, value in totals.items()}, collected_non_loss_data, timelimit_hit


def _elapsed_minutes() -> float:
    """Minutes since the program started, the maximum over ranks (so every rank takes the same decision)."""
    elapsed = torch.tensor([(progress_log.seconds_since_start()) / 60.0], device=get_current_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def evaluate_and_print_results(
    prefix,
    forward_step_func,
    data_iterator,
    model,
    iteration,
    process_non_loss_data_func,
    config,
    verbose=False,
    write_to_tensorboard=True,
    non_loss_data_func=None,
    pg_collection=None,
    p2p_communicator=None,
):
    """Validation loss and perplexity in Megatron-LM's format (printed by the last rank); hands the collected
    non-loss data to ``process_non_loss_data_func(data, iteration, writer)`` on the writing rank."""
    args = get_args()
    writer = get_tensorboard_writer() if write_to_tensorboard else None
    total_loss_dict, collected_non_loss_data, timelimit_hit = evaluate(
        forward_step_func,
        data_iterator,
        model,
        process_non_loss_data_func,
        config,
        verbose,
        non_loss_data_func=non_loss_data_func,
        pg_collection=pg_collection,
        p2p_communicator=p2p_communicator,
    )
    if timelimit_hit:
        return total_loss_dict
    string = f" validation loss at {prefix} | "
    for key, value in total_loss_dict.items():
        value = float(value)
        ppl = math.exp(min(20.0, value))  # capped: a diverged loss would overflow exp
        string += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
        if writer is not None:
            writer.add_scalar(f"{key} validation", value, iteration)
            if args.log_validation_ppl_to_tensorboard:
                writer.add_scalar(f"{key} validation ppl", ppl, iteration)
    if process_non_loss_data_func is not None and writer is not None and is_last_rank():
        process_non_loss_data_func(collected_non_loss_data, iteration, writer)
    if total_loss_dict:
        line = "-" * (len(string) + 1)
        print_rank_last(line)
        print_rank_last(string)
        print_rank_last(line)
    return total_loss_dict


# ---- skipped steps, callbacks, dry run -------------------------------------------------------------------------


def dummy_train_step(data_iterator):
    """A skipped iteration: read (and drop) the micro-batches the step would have used, so the data stays in step."""
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    for _ in range(get_num_microbatches()):
        for iterator in iterators:
            if iterator is not None:
                next(iterator)


def post_training_step_callbacks(
    model,
    optimizer,
    opt_param_scheduler,
    iteration,
    prof,
    num_floating_point_operations_since_last_log_event,
    nsys_nvtx_context=None,
):
    """After a step: advance the profiler (``prof.step()``), close the Nsight range at --profile-step-end, and
    collect garbage every --manual-gc-interval iterations with --manual-gc. The straggler detector that Megatron
    feeds ``num_floating_point_operations_since_last_log_event`` to is not part of this project."""
    args = get_args()
    if prof is not None:
        prof.step()
    if nsys_nvtx_context is not None and getattr(args, "profile", False) and iteration == args.profile_step_end:
        nsys_nvtx_context.__exit__(None, None, None)
    if getattr(args, "manual_gc", False) and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
        gc.collect()


def _print_dry_run_report(args) -> None:
    from megatron.training.layout_report import describe_parallel_layout_for_args
    from megatron.training.theoretical_memory_usage import report_theoretical_memory

    if dist.get_rank() == 0:
        print(describe_parallel_layout_for_args(args), flush=True)
        report_theoretical_memory(args, num_microbatches=get_num_microbatches(), verbose=True)
    dist.barrier()  # the others wait for rank 0's report
    sys.stdout.flush()
