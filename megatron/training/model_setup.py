"""Building a training job's pieces: the model chunks of this pipeline rank wrapped for mixed precision and DDP
(`get_model`), the optimizer and learning-rate scheduler, resuming them from `--load` (`setup_model_and_optimizer`),
and the train/validation/test datasets, loaders and iterators. `megatron.training.training` re-exports every public
name here (Megatron-LM's path) and runs the loop over what this module builds.
"""

import argparse
import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.public_api import public_api
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel import (
    DEFAULT_BUCKET_SIZE_PER_DP_RANK,
    DEFAULT_MIN_BUCKET_SIZE,
)
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    update_num_microbatches,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import MultiModuleProcessGroupCollection, ProcessGroupCollection
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_current_device
from megatron.training import checkpointing, progress_log
from megatron.training.argument_utils import core_ddp_config_from_args, core_optimizer_config_from_args
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0, unwrap_model, update_use_dist_ckpt


def arguments_from_container(cfg_container):
    """The run's arguments: ``cfg_container`` when it is the validated ``argparse.Namespace`` (what
    ``parse_and_validate_args`` returns), else the arguments already set. Megatron-LM 0.19's typed
    ``PretrainConfigContainer`` exists (``megatron.training.config``: build, save, load), but the training loop
    reads ``args``, and nothing maps a container onto them yet."""
    if cfg_container is None:
        return None
    if not isinstance(cfg_container, argparse.Namespace):
        raise ValueError(
            f"not supported yet: Megatron's configuration container ({type(cfg_container).__name__}) as pretrain's "
            "cfg_container; pass the arguments returned by megatron.training.arguments.parse_and_validate_args(), "
            "or None to use the arguments already parsed"
        )
    return cfg_container


# ---- model, optimizer, scheduler -------------------------------------------------------------------------------


@public_api("megatron.training.training")
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


@public_api("megatron.training.training")
def get_megatron_ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The DistributedDataParallelConfig of the run's flags (``--overlap-grad-reduce``, ``--ddp-bucket-size``, ...)."""
    return core_ddp_config_from_args(args)


@public_api("megatron.training.training")
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


@public_api("megatron.training.training")
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
    Megatron does). With ``use_layer_wise_distributed_optimizer`` (``--optimizer dist_muon``) the chunks get the
    same DDP: gradients are all-reduced whole and the LayerWiseDistributedOptimizer shards the step by parameter,
    so ``use_layer_wise_param_layout`` (Megatron's per-layer bucket order) leaves the numbers unchanged.
    """
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


@public_api("megatron.training.training")
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


@public_api("megatron.training.training")
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


@public_api("megatron.training.training")
def get_megatron_optimizer_config(args: Any) -> OptimizerConfig:
    """The OptimizerConfig of the run's flags (every field read by its name)."""
    return core_optimizer_config_from_args(args)


@public_api("megatron.training.training")
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
    args = arguments_from_container(cfg_container) or get_args()
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
    if args.ckpt_convert_format is not None:
        _convert_checkpoint_format(args, model, optimizer, opt_param_scheduler)
    progress_log.set_job_start_flops(args.num_floating_point_operations_so_far)
    for chunk in model:
        chunk.iteration = args.iteration  # DDP names the iteration in NaN reports
    return model, optimizer, opt_param_scheduler


def _convert_checkpoint_format(args, model, optimizer, opt_param_scheduler):
    """``--ckpt-convert-format``: save the checkpoint just loaded from --load in that format to
    ``<--ckpt-convert-save>/<format>`` and exit (Megatron-LM's offline conversion between formats)."""
    loaded_format = args.ckpt_format
    args.ckpt_format = args.ckpt_convert_format
    args.save = os.path.join(args.ckpt_convert_save, args.ckpt_convert_format)
    update_use_dist_ckpt(args)
    checkpointing.save_checkpoint(
        args.iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far
    )
    checkpointing.finalize_async_saves()
    print_rank_0(f"> converted checkpoint: {loaded_format} -> {args.ckpt_format}.")
    dist.barrier()
    raise SystemExit(0)


# ---- DDP's forward pre-hooks (the overlapped parameter all-gather) ---------------------------------------------


@public_api("megatron.training.training")
def should_disable_forward_pre_hook(args):
    """Whether DDP's forward pre-hooks (which wait for the overlapped parameter all-gather) must be lifted around
    evaluation and checkpointing: with the distributed optimizer and --overlap-param-gather."""
    return bool(args.use_distributed_optimizer and args.overlap_param_gather)


@public_api("megatron.training.training")
def enable_forward_pre_hook(model_chunks):
    """Let each chunk's submodules wait for their parameters' all-gather before their forward."""
    for chunk in model_chunks:
        chunk.enable_forward_pre_hook()


@public_api("megatron.training.training")
def disable_forward_pre_hook(model_chunks, optimizer=None, param_sync=True):
    """Remove the pre-hooks; with ``param_sync`` first gather every parameter. The gather belongs to DDP here, so
    ``optimizer`` (Megatron's layer-wise optimizer gathers itself) needs no call."""
    for chunk in model_chunks:
        chunk.disable_forward_pre_hook(param_sync=param_sync)


@public_api("megatron.training.training")
def force_param_sync(model_chunks, optimizer=None) -> None:
    """All-gather every chunk's updated parameters now (blocking). As for disable_forward_pre_hook, the gather is
    DDP's, whatever the ``optimizer``."""
    for chunk in model_chunks:
        chunk.start_param_sync(force_sync=True)


# ---- data ------------------------------------------------------------------------------------------------------


@public_api("megatron.training.training")
def get_train_valid_test_num_samples():
    """Samples each split must provide (Megatron's formula: enough for every evaluation the run will do)."""
    args = get_args()
    train_samples = args.train_samples or args.train_iters * args.global_batch_size
    # Evaluation batches are --eval-global-batch-size samples when given (Megatron's ValidationConfig field).
    eval_batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    if getattr(args, "skip_train", False) or not args.eval_interval:
        eval_runs = 1
    else:
        eval_runs = args.train_iters // args.eval_interval + 1
        start = getattr(args, "start_eval_at_iter", None)
        if start is not None:  # evaluations before --start-eval-at-iter do not happen
            eval_runs = max(0, eval_runs - start // args.eval_interval)
    return train_samples, eval_runs * args.eval_iters * eval_batch, args.eval_iters * eval_batch


@public_api("megatron.training.training")
def build_train_valid_test_datasets(build_train_valid_test_datasets_provider, train_valid_test_num_samples=None):
    """The provider's (train, valid, test) datasets for ``train_valid_test_num_samples`` (default: what the run
    needs, ``get_train_valid_test_num_samples()``)."""
    if train_valid_test_num_samples is None:
        train_valid_test_num_samples = get_train_valid_test_num_samples()
    return build_train_valid_test_datasets_provider(train_valid_test_num_samples)


@public_api("megatron.training.training")
def build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider):
    """Datasets from the provider, then Megatron's samplers resuming at the consumed sample counts; sets
    ``args.do_train`` / ``do_valid`` / ``do_test`` identically on every rank."""
    args = get_args()
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(build_train_valid_test_datasets_provider)
    loaders = [
        _data_loader(args, dataset, consumed)
        for dataset, consumed in (
            (train_ds, args.consumed_train_samples),
            (valid_ds, args.consumed_valid_samples),
            (test_ds, 0),
        )
    ]
    args.do_train = loaders[0] is not None and args.train_iters > 0
    args.do_valid = loaders[1] is not None and args.eval_iters > 0
    args.do_test = loaders[2] is not None and args.eval_iters > 0
    # Ranks that hold no dataset (middle pipeline stages, TP ranks > 0) must still agree on what will run.
    flags = torch.tensor([int(args.do_train), int(args.do_valid), int(args.do_test)], device=get_current_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    args.do_train, args.do_valid, args.do_test = (bool(f) for f in flags.tolist())
    return tuple(loaders)


def _data_loader(args, dataset, consumed_samples: int):
    if dataset is None or args.dataloader_type == "external":
        return dataset  # an external provider's datasets are its own iterables: no sampler, no batch size needed
    return build_pretraining_data_loader(
        dataset,
        consumed_samples,
        dataloader_type=args.dataloader_type,
        micro_batch_size=args.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        num_workers=args.num_workers,
    )


@public_api("megatron.training.training")
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


@public_api("megatron.training.training")
def cyclic_iter(iterable):
    """Iterate over ``iterable`` again and again."""
    while True:
        yield from iterable
