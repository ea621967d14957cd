"""The training loop: pretrain() -> model and optimizer -> data -> train() with logging, evaluation and checkpoints.

Read top to bottom it is the life of a job: `pretrain` initialises, builds the model chunks of this pipeline rank
(`get_model`), the optimizer and LR scheduler, resumes from `--load`, builds the data iterators, then `train` runs
`train_step` until an exit condition, evaluating and saving on the configured intervals.
"""

import argparse
import copy
import dataclasses
import gc
import logging
import math
import os
import sys
import time
from datetime import datetime
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.distributed_data_parallel import (
    DEFAULT_BUCKET_SIZE_PER_DP_RANK,
    DEFAULT_MIN_BUCKET_SIZE,
)
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.process_groups_config import MultiModuleProcessGroupCollection, ProcessGroupCollection
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_current_device
from megatron.training import checkpointing
from megatron.training import flops
from megatron.training.argument_utils import core_ddp_config_from_args, core_optimizer_config_from_args
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
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
from megatron.training.moe_logging import track_moe_losses
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
# When the program started (set_startup_timestamps can move it earlier): --exit-duration-in-mins counts from here.
_TRAIN_START_TIME = time.time()
_MAIN_ENTRY_TIME: Optional[float] = None
# Packed-sequence statistics of the running iteration (update_seqlen_stats_from_cu_seqlens), for exact FLOPs.
_SEQLEN_SQUARED_SUM: Optional[float] = None
_TOTAL_REAL_TOKENS: Optional[float] = None
# Floating-point operations done before this job (those of the checkpoint it resumed from), for its throughput.
_JOB_START_FLOPS = 0.0


def set_startup_timestamps(program_start=None, main_entry=None):
    """Record when the program started (``time.time()`` values; default now) and when its main entry ran, so the
    start-up time is reported and --exit-duration-in-mins counts from the real start."""
    global _TRAIN_START_TIME, _MAIN_ENTRY_TIME
    _TRAIN_START_TIME = time.time() if program_start is None else program_start
    _MAIN_ENTRY_TIME = main_entry


def print_datetime(string, override_timestamp=None):
    """``[string] datetime: <now, or override_timestamp>`` on rank 0, after a barrier."""
    if dist.is_initialized():
        dist.barrier()
    moment = datetime.now() if override_timestamp is None else datetime.fromtimestamp(override_timestamp)
    print_rank_0(f"[{string}] datetime: {moment.strftime('%Y-%m-%d %H:%M:%S')} ")


def _arguments_from(cfg_container):
    """The run's arguments: ``cfg_container`` when it is the validated ``argparse.Namespace`` (what
    ``parse_and_validate_args`` returns), else the arguments already set. Megatron-LM 0.19's typed
    ``PretrainConfigContainer`` (megatron.training.config) is not part of this project."""
    if cfg_container is None:
        return None
    if not isinstance(cfg_container, argparse.Namespace):
        raise ValueError(
            f"not supported yet: Megatron's configuration container ({type(cfg_container).__name__}) as pretrain's "
            "cfg_container; pass the arguments returned by megatron.training.arguments.parse_and_validate_args(), "
            "or None to use the arguments already parsed"
        )
    return cfg_container


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
    args = _arguments_from(cfg_container)
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
    print_rank_0(f"time to initialize megatron (seconds): {time.time() - _TRAIN_START_TIME:.3f}")
    if getattr(args, "log_progress", False):
        append_to_progress_log("Starting job")
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
        if args.save and iteration != 0 and iteration % args.save_interval != 0:
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
    checkpointing.finalize_async_saves()


def destroy_global_state():
    """Forget everything a run set up (globals, micro-batch calculator, process groups, rerun state machine), so a
    second run can start in the same process."""
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    destroy_global_vars()  # the micro-batch calculator too
    parallel_state.destroy_global_memory_buffer()
    parallel_state.destroy_model_parallel()
    destroy_rerun_state_machine()


# ---- model, optimizer, scheduler -------------------------------------------------------------------------------


def get_model(
    model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True, config=None, pg_collection=None
):
    """This rank's model chunks (one per virtual pipeline stage), on the device, fp16/bf16-wrapped, DDP-wrapped.

    ``model_provider_func(pre_process=, post_process=[, vp_stage=])`` builds a chunk; ``config`` and
    ``pg_collection``, when given, are handed to it too (``config=``, ``pg_collection=``) and ``pg_collection``
    to DDP.
    """
    args = get_args()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    extra = {name: value for name, value in (("config", config), ("pg_collection", pg_collection)) if value is not None}
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
                    **extra,
                )
                chunk.model_type = model_type
                model.append(chunk)
        else:
            chunk = model_provider_func(
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
                **extra,
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
    model = wrap_model_chunks_with_ddp(model, None, get_megatron_ddp_config(args), pg_collection=pg_collection)
    for chunk in model:
        chunk.broadcast_params()
    return model


def get_megatron_ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The DistributedDataParallelConfig of the run's flags (``--overlap-grad-reduce``, ``--ddp-bucket-size``, ...)."""
    return core_ddp_config_from_args(args)


def resolve_ddp_bucket_size(ddp_config, dp_cp_group, overlap_grad_reduce, num_parameters):
    """Elements per gradient bucket DDP will use: None (one bucket) without ``overlap_grad_reduce`` or when one
    bucket would hold all ``num_parameters`` anyway; else ``ddp_config.bucket_size``, by default
    max(40M, 1M x the size of ``dp_cp_group``)."""
    if not overlap_grad_reduce:
        return None
    bucket_size = ddp_config.bucket_size
    if bucket_size is None:
        bucket_size = max(DEFAULT_MIN_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DP_RANK * dp_cp_group.size())
    return None if bucket_size >= num_parameters else bucket_size


def wrap_model_chunks_with_ddp(
    model_chunks,
    config,
    ddp_config,
    *,
    use_layer_wise_distributed_optimizer=False,
    use_layer_wise_param_layout=True,
    DP=DistributedDataParallel,
    pg_collection=None,
    bucket_sizes=None,
    disable_bucketing_per_chunk=None,
):
    """Wrap each model chunk in ``DP`` (DistributedDataParallel, or a subclass).

    ``config`` is the model config given to DDP (default: each chunk's own); ``bucket_sizes`` (one per chunk)
    replace ``ddp_config.bucket_size`` chunk by chunk; ``disable_bucketing_per_chunk`` (one bool per chunk)
    defaults to bucketing only the first chunk (later virtual-pipeline chunks reduce in one bucket each, as
    Megatron does). ``use_layer_wise_param_layout`` only applies to the layer-wise distributed optimizer, which is
    not supported yet.
    """
    if use_layer_wise_distributed_optimizer:
        raise ValueError(
            "not supported yet: the layer-wise distributed optimizer (use_layer_wise_distributed_optimizer=True)"
        )
    for name, values in (("bucket_sizes", bucket_sizes), ("disable_bucketing_per_chunk", disable_bucketing_per_chunk)):
        if values is not None and len(values) != len(model_chunks):
            raise ValueError(f"{name} has {len(values)} entries for {len(model_chunks)} model chunks")
    wrapped = []
    for index, chunk in enumerate(model_chunks):
        chunk_ddp_config = ddp_config
        if bucket_sizes is not None:
            chunk_ddp_config = dataclasses.replace(ddp_config, bucket_size=bucket_sizes[index])
        disable_bucketing = disable_bucketing_per_chunk[index] if disable_bucketing_per_chunk else index > 0
        wrapped.append(
            DP(
                config=config if config is not None else unwrap_model(chunk).config,
                ddp_config=chunk_ddp_config,
                module=chunk,
                disable_bucketing=disable_bucketing,
                pg_collection=pg_collection,
            )
        )
    return wrapped


def get_optimizer_param_scheduler(optimizer) -> OptimizerParamScheduler:
    """LR and weight-decay schedule in samples (Megatron's units), from --train-iters or --train-samples."""
    args = get_args()
    iteration_based = args.train_samples is None
    if not iteration_based and args.train_iters is None:
        update_train_iters(args)
    unit = "iters" if iteration_based else "samples"
    if iteration_based:
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
        "max_lr": "--lr",
        "min_lr": "--min-lr",
        "lr_decay_style": "--lr-decay-style",
        "start_wd": "--start-weight-decay",
        "end_wd": "--end-weight-decay",
        "wd_incr_style": "--weight-decay-incr-style",
        "wd_incr_steps": f"--train-{unit}",
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
    scheduler.set_command_line_sources(flags, args.global_batch_size if iteration_based else None)
    return scheduler


def update_train_iters(args):
    """``args.train_iters`` for a run given in samples (``--train-samples``): the global batch size divides them,
    following the ``--rampup-batch-size`` schedule while it ramps up."""
    if args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
    else:
        rampup_samples = int(args.rampup_batch_size[2])
        iterations = consumed_samples = 0
        while consumed_samples <= rampup_samples and consumed_samples <= args.train_samples:
            update_num_microbatches(consumed_samples, consistency_check=False)
            consumed_samples += get_current_global_batch_size()
            iterations += 1
        update_num_microbatches(0, consistency_check=False)  # back to the start of the schedule
        iterations += (args.train_samples - consumed_samples) // args.global_batch_size
        args.train_iters = iterations
    print_rank_0(f"setting training iterations to {args.train_iters}")


def get_megatron_optimizer_config(args: Any) -> OptimizerConfig:
    """The OptimizerConfig of the run's flags (every field read by its name)."""
    return core_optimizer_config_from_args(args)


def setup_model_and_optimizer(
    model_type,
    model_provider_func=None,
    checkpointing_context=None,
    *,
    cfg_container=None,
    pg_collection: ProcessGroupCollection | MultiModuleProcessGroupCollection | None = None,
):
    """Model chunks, optimizer (Megatron's standard per-parameter rules: no weight decay on biases and norms,
    ``--decoupled-lr`` for embeddings and output) and scheduler; resumes their state from --load when given.

    ``cfg_container`` may be the validated arguments (the run's arguments are used otherwise); ``pg_collection``
    goes to the model provider and DDP; ``checkpointing_context`` to ``load_checkpoint``.
    """
    args = _arguments_from(cfg_container) or get_args()
    if model_provider_func is None:
        raise ValueError(
            "not supported yet: building the model from Megatron's configuration container "
            "(model_provider_func=None); pass model_provider_func"
        )
    model = get_model(model_provider_func, model_type, pg_collection=pg_collection)
    config = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(config, model, config_overrides=get_standard_config_overrides(config))
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    args.iteration, args.num_floating_point_operations_so_far = 0, 0
    if args.load is not None or args.pretrained_checkpoint is not None:
        args.iteration, args.num_floating_point_operations_so_far = checkpointing.load_checkpoint(
            model, optimizer, opt_param_scheduler, checkpointing_context=checkpointing_context
        )
    global _JOB_START_FLOPS
    _JOB_START_FLOPS = args.num_floating_point_operations_so_far
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


def build_train_valid_test_datasets(build_train_valid_test_datasets_provider, train_valid_test_num_samples=None):
    """The provider's (train, valid, test) datasets for ``train_valid_test_num_samples`` (default: what the run
    needs, ``get_train_valid_test_num_samples()``)."""
    if train_valid_test_num_samples is None:
        train_valid_test_num_samples = get_train_valid_test_num_samples()
    return build_train_valid_test_datasets_provider(train_valid_test_num_samples)


def build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider):
    """Datasets from the provider, then Megatron's samplers resuming at the consumed sample counts; sets
    ``args.do_train`` / ``do_valid`` / ``do_test`` identically on every rank."""
    args = get_args()
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(build_train_valid_test_datasets_provider)
    loaders = []
    for dataset, consumed in (
        (train_ds, args.consumed_train_samples),
        (valid_ds, args.consumed_valid_samples),
        (test_ds, 0),
    ):
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
    return tuple(loaders)


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    """Iterators over the data loaders (cycling over them with ``--dataloader-type cyclic``)."""
    args = get_args()
    loaders = build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider)
    # Starting a DataLoader iterator draws from the global generator; keep it out of the training stream so a
    # resumed run (RNG restored from the checkpoint) continues exactly like an uninterrupted one.
    with torch.random.fork_rng(devices=[]):
        return tuple(_iterator(loader, args.dataloader_type) for loader in loaders)


def _iterator(loader, dataloader_type: str):
    if loader is None:
        return None
    if dataloader_type == "cyclic":
        return cyclic_iter(loader)
    return iter(loader)


def cyclic_iter(iterable):
    """Iterate over ``iterable`` again and again."""
    while True:
        yield from iterable


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
        chunk.zero_grad_buffer()
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
        update_num_microbatches(args.consumed_train_samples, consistency_check=True)
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
        seqlen_squared_sum, total_real_tokens = consume_seqlen_stats_in_iteration()
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
        checkpointing.maybe_finalize_async_saves()
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
        compute_throughputs_and_append_to_progress_log(iteration, num_floating_point_operations_so_far)


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
        elapsed_mins = torch.tensor([(time.time() - _TRAIN_START_TIME) / 60.0], device=get_current_device())
        dist.all_reduce(elapsed_mins, op=dist.ReduceOp.MAX)
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
    elapsed = torch.tensor([(time.time() - _TRAIN_START_TIME) / 60.0], device=get_current_device())
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
        ppl = math.exp(min(20.0, value))
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


# ---- hooks, FLOPs, progress log, callbacks ----------------------------------------------------------------------


def should_disable_forward_pre_hook(args):
    """Whether DDP's forward pre-hooks (which wait for the overlapped parameter all-gather) must be lifted around
    evaluation and checkpointing: with the distributed optimizer and --overlap-param-gather."""
    return bool(args.use_distributed_optimizer and args.overlap_param_gather)


def enable_forward_pre_hook(model_chunks):
    """Let each chunk's submodules wait for their parameters' all-gather before their forward."""
    for chunk in model_chunks:
        chunk.enable_forward_pre_hook()


def disable_forward_pre_hook(model_chunks, optimizer=None, param_sync=True):
    """Remove the pre-hooks; with ``param_sync`` first gather every parameter. The gather belongs to DDP here, so
    ``optimizer`` (Megatron's layer-wise optimizer gathers itself) needs no call."""
    for chunk in model_chunks:
        chunk.disable_forward_pre_hook(param_sync=param_sync)


def force_param_sync(model_chunks, optimizer=None) -> None:
    """All-gather every chunk's updated parameters now (blocking). As for disable_forward_pre_hook, the gather is
    DDP's, whatever the ``optimizer``."""
    for chunk in model_chunks:
        chunk.start_param_sync(force_sync=True)


def update_seqlen_stats_from_cu_seqlens(cu_seqlens):
    """Add a packed micro-batch's sequences (cumulative lengths ``cu_seqlens``, THD layout) to this iteration's
    statistics: the sum of squared lengths (attention FLOPs) and the number of real tokens (everything else)."""
    global _SEQLEN_SQUARED_SUM, _TOTAL_REAL_TOKENS
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
    _SEQLEN_SQUARED_SUM = (_SEQLEN_SQUARED_SUM or 0.0) + float((lengths * lengths).sum())
    _TOTAL_REAL_TOKENS = (_TOTAL_REAL_TOKENS or 0.0) + float(lengths.sum())


def consume_seqlen_stats_in_iteration() -> Tuple[Optional[float], Optional[float]]:
    """(sum of squared sequence lengths, real tokens) recorded this iteration, summed over the data-parallel ranks,
    and reset; (None, None) when no packed sequences were recorded."""
    global _SEQLEN_SQUARED_SUM, _TOTAL_REAL_TOKENS
    if _SEQLEN_SQUARED_SUM is None:
        return None, None
    stats = torch.tensor([_SEQLEN_SQUARED_SUM, _TOTAL_REAL_TOKENS], dtype=torch.float64, device=get_current_device())
    dist.all_reduce(stats, group=parallel_state.get_data_parallel_group())
    _SEQLEN_SQUARED_SUM = _TOTAL_REAL_TOKENS = None
    return stats[0].item(), stats[1].item()


def num_floating_point_operations(args, batch_size, seqlen_squared_sum_in_batch=None, total_real_tokens_in_batch=None):
    """Training FLOPs of one iteration (megatron.training.flops' model) over ``batch_size`` sequences of
    --seq-length tokens, or, for packed sequences, over ``total_real_tokens_in_batch`` tokens whose attention
    covers ``seqlen_squared_sum_in_batch`` (the sum of squared sequence lengths)."""
    if seqlen_squared_sum_in_batch is None or total_real_tokens_in_batch is None:
        return flops.num_floating_point_operations(args, batch_size)
    # The count per sequence of s tokens is a*s + c*s^2 (linear layers and logits; attention scores); two
    # evaluations of the model at s = 1 and s = 2 give a and c.
    one, two = (
        flops.num_floating_point_operations(argparse.Namespace(**{**vars(args), "seq_length": s}), 1) for s in (1, 2)
    )
    per_square = (two - 2 * one) / 2
    per_token = one - per_square
    return per_token * total_real_tokens_in_batch + per_square * seqlen_squared_sum_in_batch


def _progress_log_path(args) -> str:
    return os.path.join(args.save, "progress.txt")


def get_start_time_from_progress_log():
    """(start time, floating-point operations done before it) of this run in the progress log: the first
    "Starting job" after the last change of world size, and the operations of the last checkpoint saved before
    it. The log's lines are tab-separated: time, job id, "# GPUs: N", event, then event fields."""
    args = get_args()
    start_time = start_flops = None
    latest_flops = 0.0
    with open(_progress_log_path(args)) as progress:
        for line in progress:
            fields = line.rstrip("\n").split("\t")
            world_size = int(fields[2].split(":")[1])
            if fields[3] == "Saved checkpoint":
                latest_flops = float(fields[7].split(":")[1])
            if world_size != args.world_size:
                start_time = start_flops = None
                continue
            if fields[3] == "Starting job" and start_time is None:
                start_time, start_flops = fields[0], latest_flops
    if start_time is None:
        raise ValueError(f"{_progress_log_path(args)} records no start of a job at world size {args.world_size}")
    return datetime.strptime(start_time, "%Y-%m-%d %H:%M:%S"), start_flops


def compute_throughputs_and_append_to_progress_log(iteration, num_floating_point_operations_so_far):
    """Append "Saved checkpoint" with this job's and the run's throughput (TFLOP/s per device), the operations and
    the tokens so far to the progress log (--log-progress)."""
    args = get_args()
    if args.save is None:
        return
    start_time, start_flops = get_start_time_from_progress_log()
    elapsed_job = time.time() - _TRAIN_START_TIME
    elapsed_run = (datetime.now() - start_time).total_seconds()
    job_flops = num_floating_point_operations_so_far - _JOB_START_FLOPS
    job_throughput = job_flops / max(elapsed_job, 1e-9) / 1e12 / args.world_size
    run_throughput = (
        (num_floating_point_operations_so_far - start_flops) / max(elapsed_run, 1e-9) / 1e12 / (args.world_size)
    )
    tokens_so_far = args.consumed_train_samples * args.seq_length
    append_to_progress_log(
        f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job_throughput:.1f} TFLOP/s/GPU\t"
        f"Cumulative throughput: {run_throughput:.1f} TFLOP/s/GPU\t"
        f"Floating-point operations: {num_floating_point_operations_so_far:.2e}\t"
        f"Tokens (in billions): {tokens_so_far / 10**9:.2f}"
    )


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
    dist.barrier()
    sys.stdout.flush()
