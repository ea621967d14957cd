"""The training loop: pretrain() -> model and optimizer -> data -> train() with logging, evaluation and checkpoints.

Read top to bottom it is the life of a job: `pretrain` initialises, builds the model chunks of this pipeline rank
(`get_model`), the optimizer and LR scheduler, resumes from `--load`, builds the data iterators, then `train` runs
`train_step` until an exit condition, evaluating and saving on the configured intervals.
"""

import dataclasses
import logging
import math
import sys
import time
from datetime import datetime
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import get_num_microbatches, update_num_microbatches
from megatron.core.optimizer import (
    OptimizerConfig,
    ParamKey,
    ParamWithNamePredicate,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_current_device
from megatron.training import checkpointing
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.dist_signal_handler import DistributedSignalHandler
from megatron.training.flops import num_floating_point_operations
from megatron.training.global_vars import get_args, get_tensorboard_writer, get_timers, get_wandb_writer
from megatron.training.initialize import initialize_megatron
from megatron.training.utils import (
    calc_params_l2_norm,
    print_rank_0,
    print_rank_last,
    report_memory,
    unwrap_model,
)

logger = logging.getLogger(__name__)
_TRAIN_START_TIME = time.time()
_EXIT_SIGNAL_HANDLER: Optional[DistributedSignalHandler] = None


def pretrain(
    train_valid_test_dataset_provider: Callable,
    model_provider: Callable,
    model_type: ModelType,
    forward_step_func: Callable,
    process_non_loss_data_func: Optional[Callable] = None,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: dict = {},
) -> None:
    """Megatron-LM's entry point: initialise, build everything, train, evaluate, save."""
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    args = get_args()
    _install_exit_signal_handler(args)
    if getattr(args, "dry_run", False):
        _print_dry_run_report(args)
        return

    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
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
    if not args.skip_train and args.train_iters > 0:
        iteration, _ = train(
            forward_step_func, model, optimizer, opt_param_scheduler, train_iterator, valid_iterator,
            process_non_loss_data_func, config,
        )
        if args.save and iteration != 0 and iteration % args.save_interval != 0:
            checkpointing.save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                          args.num_floating_point_operations_so_far)
    if args.do_valid and args.eval_iters > 0:
        evaluate_and_print_results(f"iteration {iteration} on validation set", forward_step_func, valid_iterator,
                                   model, iteration, process_non_loss_data_func, config, verbose=True)
    if args.do_test and args.eval_iters > 0:
        evaluate_and_print_results(f"iteration {iteration} on test set", forward_step_func, test_iterator, model,
                                   iteration, process_non_loss_data_func, config, verbose=True)
    checkpointing.finalize_async_saves()


# ---- model, optimizer, scheduler -------------------------------------------------------------------------------


def get_model(model_provider_func: Callable, model_type=ModelType.encoder_or_decoder, wrap_with_ddp: bool = True):
    """This rank's model chunks (one per virtual pipeline stage), on the device, fp16/bf16-wrapped, DDP-wrapped."""
    args = get_args()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    # With --use-cpu-initialization the weights come from per-layer streams of this seed (layout-independent);
    # build from the base seed, then restore the per-stage stream set at initialisation for dropout.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        if vpp is not None:
            model = []
            for vp_stage in range(vpp):
                chunk = model_provider_func(
                    pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    vp_stage=vp_stage,
                )
                chunk.model_type = model_type
                model.append(chunk)
        else:
            chunk = model_provider_func(
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
            )
            chunk.model_type = model_type
            model = [chunk]

    num_parameters = sum(sum(p.numel() for p in chunk.parameters()) for chunk in model)
    if parallel_state.get_data_parallel_rank() == 0:
        print(
            f" > number of parameters on (tensor, pipeline) model parallel rank "
            f"({parallel_state.get_tensor_model_parallel_rank()}, "
            f"{parallel_state.get_pipeline_model_parallel_rank()}): {num_parameters}",
            flush=True,
        )
    model = [chunk.to(get_current_device()) for chunk in model]
    if args.fp16 or args.bf16:
        model = [Float16Module(chunk.config, chunk) for chunk in model]
    if not wrap_with_ddp:
        return model
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
    )
    model = [
        DistributedDataParallel(
            config=unwrap_model(chunk).config,
            ddp_config=ddp_config,
            module=chunk,
            # Later virtual-pipeline chunks reduce their gradients in one bucket each.
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(model)
    ]
    for chunk in model:
        chunk.broadcast_params()
    return model


def get_optimizer_param_scheduler(optimizer) -> OptimizerParamScheduler:
    """LR and weight-decay schedule in samples (Megatron's units), from --train-iters or --train-samples."""
    args = get_args()
    unit = "iters" if args.train_iters else "samples"
    if args.train_iters:
        lr_decay_steps = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
        wd_incr_steps = args.train_iters * args.global_batch_size
        wsd_decay_steps = (args.lr_wsd_decay_iters or 0) * args.global_batch_size
        if args.lr_warmup_fraction is not None:
            lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = args.lr_warmup_iters * args.global_batch_size
    else:
        lr_decay_steps = args.lr_decay_samples or args.train_samples
        wd_incr_steps = args.train_samples
        wsd_decay_steps = args.lr_wsd_decay_samples or 0
        if args.lr_warmup_fraction is not None:
            lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = args.lr_warmup_samples
    # Which flag set each value, so that a resume mismatch names it (in iterations for an iteration-based run).
    flags = {
        "max_lr": "--lr", "min_lr": "--min-lr", "lr_decay_style": "--lr-decay-style",
        "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
        "wd_incr_style": "--weight-decay-incr-style", "wd_incr_steps": f"--train-{unit}",
        "lr_decay_steps": f"--lr-decay-{unit}" if getattr(args, f"lr_decay_{unit}") else f"--train-{unit}",
        "lr_warmup_steps": "--lr-warmup-fraction" if args.lr_warmup_fraction is not None else f"--lr-warmup-{unit}",
    }
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
    scheduler.set_command_line_sources(flags, args.global_batch_size if args.train_iters else None)
    return scheduler


def _optimizer_config(args) -> OptimizerConfig:
    names = {field.name for field in dataclasses.fields(OptimizerConfig)}
    return OptimizerConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def _config_overrides(config, no_wd_decay_cond, scale_lr_cond, lr_mult):
    """Megatron-LM's legacy ``no_wd_decay_cond(name, param)`` / ``scale_lr_cond`` as core's config_overrides."""
    overrides = get_standard_config_overrides(config)
    if no_wd_decay_cond is not None:  # replaces the default no-decay rule, keeps the decoupled lr
        overrides = {key: value for key, value in overrides.items() if value != {"wd_mult": 0.0}}
        predicate = ParamWithNamePredicate("no_wd_decay_cond", lambda param, name: no_wd_decay_cond(name, param))
        overrides[ParamKey(with_name_predicate=predicate)] = {"wd_mult": 0.0}
    if scale_lr_cond is not None:
        predicate = ParamWithNamePredicate("scale_lr_cond", lambda param, name: scale_lr_cond(name, param))
        overrides[ParamKey(with_name_predicate=predicate)] = {"lr_mult": lr_mult}
    return overrides


def setup_model_and_optimizer(model_provider_func, model_type, no_wd_decay_cond=None, scale_lr_cond=None,
                              lr_mult=1.0):
    """Model chunks, optimizer and scheduler; resumes their state from --load when given."""
    args = get_args()
    model = get_model(model_provider_func, model_type)
    config = _optimizer_config(args)
    optimizer = get_megatron_optimizer(
        config, model, config_overrides=_config_overrides(config, no_wd_decay_cond, scale_lr_cond, lr_mult)
    )
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    args.iteration, args.num_floating_point_operations_so_far = 0, 0
    if args.load is not None or args.pretrained_checkpoint is not None:
        args.iteration, args.num_floating_point_operations_so_far = checkpointing.load_checkpoint(
            model, optimizer, opt_param_scheduler
        )
    for chunk in model:
        chunk.iteration = args.iteration  # DDP names the iteration in NaN reports
    return model, optimizer, opt_param_scheduler


# ---- data ------------------------------------------------------------------------------------------------------


def get_train_valid_test_num_samples():
    """Samples each split must provide (Megatron's formula: enough for every evaluation the run will do)."""
    args = get_args()
    train_samples = args.train_samples or args.train_iters * args.global_batch_size
    eval_runs = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    return (
        train_samples,
        eval_runs * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    )


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    """Datasets from the provider, then Megatron's samplers resuming at the consumed sample counts."""
    args = get_args()
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets_provider(get_train_valid_test_num_samples())
    loaders = []
    for dataset, consumed in ((train_ds, args.consumed_train_samples), (valid_ds, args.consumed_valid_samples),
                              (test_ds, 0)):
        loaders.append(
            build_pretraining_data_loader(
                dataset,
                consumed,
                dataloader_type=args.dataloader_type,
                micro_batch_size=args.micro_batch_size,
                data_parallel_rank=parallel_state.get_data_parallel_rank(),
                data_parallel_size=parallel_state.get_data_parallel_world_size(),
                num_workers=args.num_workers,
            )
            if dataset is not None
            else None
        )
    args.do_train = loaders[0] is not None and args.train_iters > 0
    args.do_valid = loaders[1] is not None and args.eval_iters > 0
    args.do_test = loaders[2] is not None and args.eval_iters > 0
    # Ranks that hold no dataset (middle pipeline stages, TP ranks > 0) must still agree on what will run.
    flags = torch.tensor([int(args.do_train), int(args.do_valid), int(args.do_test)], device=get_current_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    args.do_train, args.do_valid, args.do_test = (bool(f) for f in flags.tolist())
    # Starting a DataLoader iterator draws from the global generator; keep it out of the training stream so a
    # resumed run (RNG restored from the checkpoint) continues exactly like an uninterrupted one.
    with torch.random.fork_rng(devices=[]):
        return tuple(_iterator(loader, args.dataloader_type) for loader in loaders)


def _iterator(loader, dataloader_type: str):
    if loader is None:
        return None
    if dataloader_type == "cyclic":
        return _cyclic_iter(loader)
    return iter(loader)


def _cyclic_iter(loader):
    while True:
        yield from loader


# ---- one step --------------------------------------------------------------------------------------------------


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    """Forward/backward over the global batch's micro-batches, optimizer step, scheduler step, reduced losses."""
    args = get_args()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=get_num_microbatches(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=None,
        forward_only=False,
    )
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    if update_successful:
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
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            reduced[key] = total[0] / total[1].clamp_min(1)
        else:
            mean = torch.stack(values).mean().view(1)
            dist.all_reduce(mean, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            reduced[key] = mean[0] / parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return reduced


# ---- the loop --------------------------------------------------------------------------------------------------


def _configure_hooks(config, model, optimizer) -> None:
    args = get_args()
    if args.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if args.align_grad_reduce:
            grad_sync = [chunk.start_grad_sync for chunk in model]
            config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    if args.overlap_param_gather and args.align_param_gather:
        param_sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.timers = None


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          process_non_loss_data_func, config):
    """Run train_step until --train-iters (or an exit condition); returns (iteration, flops so far)."""
    args = get_args()
    timers = get_timers()
    _configure_hooks(config, model, optimizer)
    for chunk in model:
        chunk.train()
    iteration = args.iteration
    total_loss_dict: Dict[str, torch.Tensor] = {}
    report_memory_flag = True
    signal_handler = _install_exit_signal_handler(args)
    timers("interval-time", log_level=0).start(barrier=True)
    print_rank_0(f"[before the start of training step] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}")
    while iteration < args.train_iters:
        update_num_microbatches(args.consumed_train_samples, consistency_check=True)
        loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config
        )
        iteration += 1
        args.iteration = iteration
        batch_size = parallel_state.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
        args.consumed_train_samples += batch_size
        args.num_floating_point_operations_so_far += num_floating_point_operations(args, batch_size)
        report_memory_flag = training_log(
            loss_dict, total_loss_dict, optimizer.param_groups[0]["lr"], iteration, float(optimizer.get_loss_scale()),
            report_memory_flag, skipped_iter, grad_norm, num_zeros_in_grad, model, batch_size,
        )
        if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
            evaluate_and_print_results(f"iteration {iteration}", forward_step_func, valid_data_iterator, model,
                                       iteration, process_non_loss_data_func, config, verbose=False)
        checkpointing.maybe_finalize_async_saves()
        if _should_exit(iteration, model, optimizer, opt_param_scheduler, signal_handler):
            # As in Megatron-LM, an exit condition ends the job here, once its checkpoint is written: no second
            # end-of-training save and no final evaluation eat into a scheduler's grace period.
            checkpointing.finalize_async_saves()
            sys.exit(0)
    return iteration, args.num_floating_point_operations_so_far


def _install_exit_signal_handler(args) -> Optional[DistributedSignalHandler]:
    """With --exit-signal-handler, catch SIGTERM from start-up on, as Megatron-LM does: a signal that arrives while
    the job still builds its model and data is honoured at the first iteration boundary instead of killing the rank."""
    global _EXIT_SIGNAL_HANDLER
    if args.exit_signal_handler and _EXIT_SIGNAL_HANDLER is None:
        _EXIT_SIGNAL_HANDLER = DistributedSignalHandler().__enter__()
    return _EXIT_SIGNAL_HANDLER


def _should_exit(iteration, model, optimizer, opt_param_scheduler, signal_handler) -> bool:
    """Save on the interval; stop (after saving, once) on a signal, --exit-interval or --exit-duration-in-mins."""
    args = get_args()
    saved_on_interval = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
    if saved_on_interval:
        checkpointing.save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                      args.num_floating_point_operations_so_far)
    reason = _exit_reason(iteration, signal_handler)
    if reason is None:
        return False
    if args.save and not saved_on_interval:
        checkpointing.save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                      args.num_floating_point_operations_so_far)
    print_rank_0(f"exiting program {reason}")
    return True


def _exit_reason(iteration, signal_handler) -> Optional[str]:
    """Why the job should stop after this iteration, or None (every check is the same on every rank)."""
    args = get_args()
    if signal_handler is not None and any(signal_handler.signals_received()):
        return f"after receiving a termination signal at iteration {iteration}"
    if args.exit_duration_in_mins:
        elapsed_mins = torch.tensor([(time.time() - _TRAIN_START_TIME) / 60.0], device=get_current_device())
        dist.all_reduce(elapsed_mins, op=dist.ReduceOp.MAX)
        if elapsed_mins.item() > args.exit_duration_in_mins:
            return f"after {elapsed_mins.item():.1f} minutes"
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"at iteration {iteration}"
    return None


# ---- logging ---------------------------------------------------------------------------------------------------


_SKIPPED, _NAN, _ADVANCED = "skipped iterations", "nan iterations", "advanced iterations"


def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag, skipped_iter,
                 grad_norm, num_zeros_in_grad, model, batch_size) -> bool:
    """Accumulate losses and print Megatron-LM's log line every --log-interval iterations (from the last rank)."""
    args = get_args()
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

    if iteration % args.log_interval != 0:
        return report_memory_flag
    params_norm = calc_params_l2_norm(model) if args.log_params_norm else None
    elapsed_time = timers("interval-time").elapsed(barrier=True)
    elapsed_per_iteration = elapsed_time / args.log_interval
    throughput = num_floating_point_operations(args, batch_size) / (
        elapsed_per_iteration * 1e12 * args.world_size
    )
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
    log_string += " number of skipped iterations: {:3d} |".format(total_loss_dict[_SKIPPED])
    log_string += " number of nan iterations: {:3d} |".format(total_loss_dict[_NAN])
    total_loss_dict[_ADVANCED] = total_loss_dict[_SKIPPED] = total_loss_dict[_NAN] = 0
    print_rank_last(log_string)
    if report_memory_flag:
        print_rank_last(report_memory(f"iteration {iteration}"))
        report_memory_flag = False
    return report_memory_flag


# ---- evaluation ------------------------------------------------------------------------------------------------


def evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False):
    """Average loss over --eval-iters global batches, without gradients."""
    args = get_args()
    for chunk in model:
        chunk.eval()
    eval_num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    totals: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for step in range(args.eval_iters):
            if verbose:
                print_rank_0(f"Evaluating iter {step + 1}/{args.eval_iters}")
            losses = get_forward_backward_func()(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=eval_num_microbatches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                decoder_seq_length=None,
                forward_only=True,
            )
            for key, value in _reduce_losses_over_data_parallel(losses).items():
                totals[key] = totals.get(key, 0) + value
            args.consumed_valid_samples += args.global_batch_size
    for chunk in model:
        chunk.train()
    return {key: value / args.eval_iters for key, value in totals.items()}


def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration,
                               process_non_loss_data_func, config, verbose=False, write_to_tensorboard=True):
    """Validation loss and perplexity in Megatron-LM's format (printed by the last rank)."""
    args = get_args()
    writer = get_tensorboard_writer() if write_to_tensorboard else None
    total_loss_dict = evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose)
    string = f" validation loss at {prefix} | "
    for key, value in total_loss_dict.items():
        value = float(value)
        ppl = math.exp(min(20.0, value))
        string += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
        if writer is not None:
            writer.add_scalar(f"{key} validation", value, iteration)
            if args.log_validation_ppl_to_tensorboard:
                writer.add_scalar(f"{key} validation ppl", ppl, iteration)
    if total_loss_dict:
        line = "-" * (len(string) + 1)
        print_rank_last(line)
        print_rank_last(string)
        print_rank_last(line)
    return total_loss_dict


def _print_dry_run_report(args) -> None:
    from megatron.training.layout_report import describe_parallel_layout_for_args
    from megatron.training.theoretical_memory_usage import report_theoretical_memory

    if dist.get_rank() == 0:
        print(describe_parallel_layout_for_args(args), flush=True)
        report_theoretical_memory(args, num_microbatches=get_num_microbatches(), verbose=True)
    dist.barrier()
    sys.stdout.flush()
