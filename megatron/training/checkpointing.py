"""Training checkpoints (Megatron-LM's ``megatron.training.checkpointing``): where each iteration's checkpoint lives,
which one is "latest", and saving and loading a training job through ``megatron.core.dist_checkpointing``.

``<save>/iter_0000100/`` holds the distributed (``torch_dist``) checkpoint of iteration 100 (``release/`` for a
release checkpoint) and ``<save>/latest_checkpointed_iteration.txt`` holds the iteration number (or ``release``), as
in Megatron-LM. The tracker is replaced atomically and only after every rank's data is durable, so a save
interrupted at any moment leaves the previous checkpoint as "latest" and loadable; :func:`find_checkpoint_to_load`
refuses an incomplete one.

A checkpoint holds what Megatron-LM's do: ``model`` (or ``model0``, ``model1``, ... per virtual stage),
``optimizer``, ``opt_param_scheduler``, ``rng_state``, ``rerun_state_machine``, ``args``, ``checkpoint_version``
(3.0), ``iteration``, ``num_floating_point_operations_so_far`` and ``content_metadata`` (the flags the model and
optimizer built their sharded state with).
"""

import argparse
import enum
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from torch.distributed import ProcessGroup

from megatron.core.public_api import public_api

# The directory layout lives in megatron.core (the HF conversion needs it too) and the checkpoint's arguments in
# checkpoint_args; both are re-exported here, Megatron-LM's public path.
from megatron.core.dist_checkpointing.checkpoint_dir import (  # noqa: F401
    CHECKPOINT_VERSION,
    RELEASE_DIRNAME,
    TRACKER_FNAME,
    checkpoint_exists,
    describe_incomplete_checkpoints,
    find_checkpoint_rank_0,
    find_checkpoint_to_load,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    get_distributed_optimizer_checkpoint_name,
    incomplete_checkpoints,
    read_metadata,
    remove_incomplete_checkpoints,
    write_tracker_atomically,
)
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.training.checkpoint_args import (  # noqa: F401
    check_checkpoint_args,
    get_load_checkpoint_path_by_args,
    load_args_from_checkpoint,
)
from megatron.training.fsdp_dtensor_checkpointing import FSDP_DTENSOR, fsdp_dtensor_state_dict
from megatron.training.hf_checkpoint import hugging_face_load_dir, load_hf_checkpoint
from megatron.training.legacy_checkpointing import save_grads  # noqa: F401  (Megatron's public path)
from megatron.training.plain_checkpointing import (
    PLAIN_FORMATS,
    apply_plain_checkpoint,
    format_to_load,
    read_plain_checkpoint,
    restore_rng_state,
    save_plain_checkpoint,
)
from megatron.training.plain_checkpointing import model_key as _model_key


class CheckpointType(enum.Enum):
    """Megatron's kinds of checkpoint: legacy per-rank ``torch`` files, node-local (NVRx), global
    ``torch_dist``, PyTorch DCP, FSDP DTensor. This project writes and reads all but LOCAL ones."""

    LEGACY = enum.auto()
    LOCAL = enum.auto()
    GLOBAL = enum.auto()
    TORCH_DCP = enum.auto()
    FSDP_DTENSOR = enum.auto()


# ---- versions and iterations of the loaded checkpoint ------------------------------------------------------------

_CHECKPOINT_VERSION: Optional[float] = None
_LOADED_ITERATION: Optional[int] = None


def set_checkpoint_version(value):
    """Record the ``checkpoint_version`` of the checkpoint being loaded; a second, different one is refused."""
    global _CHECKPOINT_VERSION
    if _CHECKPOINT_VERSION is not None and _CHECKPOINT_VERSION != value:
        raise CheckpointingException(
            f"checkpoint versions do not match: {_CHECKPOINT_VERSION} was loaded before, now {value}"
        )
    _CHECKPOINT_VERSION = value


def get_checkpoint_version():
    """The ``checkpoint_version`` of the loaded checkpoint (None before a load)."""
    return _CHECKPOINT_VERSION


def set_loaded_iteration(value):
    global _LOADED_ITERATION
    _LOADED_ITERATION = value


def get_loaded_iteration():
    """The iteration of the checkpoint loaded last (None before a load)."""
    return _LOADED_ITERATION


# ---- files ---------------------------------------------------------------------------------------------------


def ensure_directory_exists(filename, check_parent=True):
    """Create the directory of ``filename`` (or, with ``check_parent=False``, ``filename`` itself)."""
    directory = os.path.dirname(filename) if check_parent else filename
    os.makedirs(directory, exist_ok=True)


# ---- non-persistent checkpoints: only the latest few are kept ------------------------------------------------------

_DELETIONS: List[threading.Thread] = []


def cleanup_old_non_persistent_checkpoint(save_dir, leave_ckpt_num=1, do_async=False):
    """Delete all but the newest ``leave_ckpt_num`` iteration directories of ``save_dir`` (rank 0 deletes; in a
    background thread with ``do_async``, joined by :func:`finalize_deletion_processes`)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:  # one rank deletes; others would race it
        return
    iterations = sorted(Path(save_dir).glob("iter_*"), key=lambda path: int(path.name[len("iter_") :]))
    old = iterations[:-leave_ckpt_num] if leave_ckpt_num > 0 else iterations

    def remove():
        for path in old:
            shutil.rmtree(path, ignore_errors=True)

    if do_async:
        thread = threading.Thread(target=remove, name="checkpoint-cleanup", daemon=True)
        thread.start()
        _DELETIONS.append(thread)
    else:
        remove()


def finalize_deletion_processes(blocking=False):
    """Forget finished background deletions; with ``blocking`` wait for all of them first."""
    for thread in list(_DELETIONS):
        if blocking:
            thread.join()
        if not thread.is_alive():
            _DELETIONS.remove(thread)


def maybe_save_dataloader_state(
    train_iterator, iteration, dataloader_save_path, *, tp_group=None, pp_group=None, dp_group=None
):
    """Save the data loader's own state, for loaders that keep one (``train_iterator.iterable.save_state()``; the
    built-in loaders resume from the consumed-sample count instead), to
    ``<dataloader_save_path>/iter_<iteration>/train_dataloader_dprank<dp:03d>.pt`` as
    ``{"dataloader_state_dict": state}``: one file per data-parallel rank, written by tensor rank 0 of the first
    pipeline stage. Nothing happens without an iterator or a path; a loader without ``save_state`` is an error."""
    import torch
    import torch.distributed as dist

    if train_iterator is None or not dataloader_save_path:
        return
    if not hasattr(getattr(train_iterator, "iterable", None), "save_state"):
        raise RuntimeError(
            f"--dataloader-save {dataloader_save_path}: the training data iterator ({type(train_iterator).__name__}) "
            "has no iterable.save_state() to save"
        )
    tp_group, pp_group, _, dp_group = _groups(tp_group, pp_group, None, dp_group)
    if dist.get_rank(tp_group) != 0 or dist.get_rank(pp_group) != 0:  # one loader state per DP replica
        return
    dp_rank = dist.get_rank(dp_group)
    path = os.path.join(
        get_checkpoint_name(dataloader_save_path, iteration, return_base_dir=True),
        f"train_dataloader_dprank{dp_rank:03d}.pt",
    )
    ensure_directory_exists(path)
    torch.save({"dataloader_state_dict": train_iterator.iterable.save_state()}, path)


def fix_query_key_value_ordering(model, checkpoint_version):
    """Checkpoints of version 2.0 and later (all that this project and current Megatron write) store the fused
    QKV weights in the order the model uses; older ones, which need reordering, are refused."""
    if checkpoint_version is not None and checkpoint_version < 2.0:
        raise CheckpointingException(
            f"not supported yet: checkpoints of version {checkpoint_version} (< 2.0), whose query/key/value "
            "weights need reordering; convert the checkpoint with a Megatron-LM release first"
        )


# ---- saving and loading a training job ---------------------------------------------------------------------------
# The functions below use the training globals (arguments, model chunks, optimizer, scheduler).

_ASYNC_CALLS = None


def _async_calls():
    global _ASYNC_CALLS
    if _ASYNC_CALLS is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _ASYNC_CALLS = AsyncCallsQueue()
    return _ASYNC_CALLS


def maybe_finalize_async_saves(blocking: bool = False) -> None:
    """Finish asynchronous saves whose writes are done on every rank (a collective; call it on every rank)."""
    if _ASYNC_CALLS is not None:
        _ASYNC_CALLS.maybe_finalize_async_calls(blocking=blocking)


def finalize_async_saves() -> None:
    """Wait for every pending asynchronous save and mark it complete (call before the job exits)."""
    maybe_finalize_async_saves(blocking=True)


def _groups(tp_group, pp_group, dp_cp_group, dp_group):
    """The tensor, pipeline, data x context and data-parallel groups: the ones given, else parallel_state's."""
    from megatron.core import parallel_state

    return (
        tp_group or parallel_state.get_tensor_model_parallel_group(),
        pp_group or parallel_state.get_pipeline_model_parallel_group(),
        dp_cp_group or parallel_state.get_data_parallel_group(with_context_parallel=True),
        dp_group or parallel_state.get_data_parallel_group(),
    )


def get_rng_state(
    ckpt_format: str,
    tp_group: ProcessGroup,
    pp_group: ProcessGroup,
    dp_cp_group: Optional[ProcessGroup] = None,
    dp_group: Optional[ProcessGroup] = None,
    key_prefix: str = "",
) -> Union[List[Dict[str, Any]], ShardedObject]:
    """This rank's random states (Python, NumPy, torch, the accelerator's, the model-parallel tracker's) as a
    list: one entry, or with --data-parallel-random-init one per data-parallel rank. For ``torch_dist`` it is a
    ShardedObject ``<key_prefix>rng_state`` over (pipeline, tensor) ranks, replicated over data x context ranks."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron.core import tensor_parallel
    from megatron.core.utils import cuda_available
    from megatron.training.global_vars import get_args

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": tensor_parallel.random.get_device_rng_state() if cuda_available() else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    tp_group, pp_group, dp_cp_group, dp_group = _groups(tp_group, pp_group, dp_cp_group, dp_group)
    states = [state]
    if get_args().data_parallel_random_init:
        states = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(states, state, group=dp_group)  # DP ranks draw differently: keep each one's
    if ckpt_format == "fsdp_dtensor":  # one entry per (pipeline, tensor) rank, as Megatron-LM keys it
        return {f"({dist.get_rank(pp_group)}, {dist.get_rank(tp_group)})": states}
    if ckpt_format != "torch_dist":
        return states
    return ShardedObject(
        f"{key_prefix}rng_state",
        states,
        (dist.get_world_size(pp_group), dist.get_world_size(tp_group)),
        (dist.get_rank(pp_group), dist.get_rank(tp_group)),
        replica_id=dist.get_rank(dp_cp_group),  # replicated over DP x CP: one of them writes it
    )


def _content_metadata(args) -> dict:
    """Megatron's ``content_metadata``: how this run's model and optimizer lay out their sharded state. As in
    Megatron-LM the distributed optimizer writes ``dp_reshardable`` (bucket space: reloads at another data-parallel
    size) or, with --dist-ckpt-optim-fully-reshardable, ``fully_reshardable`` (model space: any layout)."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        if args.dist_ckpt_optim_fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            mem_efficient = args.distrib_optim_fully_reshardable_mem_efficient
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = mem_efficient
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _checkpoint_content_metadata(common: dict, args) -> dict:
    """The layout flags the checkpoint was written with. Megatron-Core before 0.13 wrote none: its distributed
    optimizer used ``fully_sharded_model_space`` with --ckpt-fully-parallel-save, else ``dp_zero_gather_scatter``."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if metadata is not None:
        return metadata
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": False}
    if args.use_distributed_optimizer:
        fully_parallel = getattr(common.get("args"), "ckpt_fully_parallel_save", False)
        metadata["distrib_optim_sharding_type"] = (
            "fully_sharded_model_space" if fully_parallel else "dp_zero_gather_scatter"
        )
    return metadata


# What orders the distributed optimizer's buckets besides the tensor/pipeline sizes: the bucket-space layouts
# store flat bucket slices, so a change here would hand each parameter another parameter's state.
_BUCKET_ORDER_FLAGS = (
    ("virtual_pipeline_model_parallel_size", "--num-virtual-stages-per-pipeline-rank"),
    ("expert_model_parallel_size", "--expert-model-parallel-size"),
    ("expert_tensor_parallel_size", "--expert-tensor-parallel-size"),
    ("transformer_impl", "--transformer-impl"),
)


def _bucket_layout_changes(saved_args, args, tp_size: int, pp_size: int) -> List[str]:
    """How this run's model layout differs from the saving run's, one ``--flag saved -> now`` per difference."""
    if saved_args is None:
        return ["the checkpoint does not record the layout it was saved with"]
    found = {
        "--tensor-model-parallel-size": (saved_args.tensor_model_parallel_size, tp_size),
        "--pipeline-model-parallel-size": (saved_args.pipeline_model_parallel_size, pp_size),
    }
    for field, flag in _BUCKET_ORDER_FLAGS:
        if hasattr(saved_args, field):  # older checkpoints may lack a field: nothing to compare then
            found[flag] = (getattr(saved_args, field), getattr(args, field, None))
    return [f"{flag} {saved} -> {now}" for flag, (saved, now) in found.items() if saved != now]


def _check_optimizer_loadable(args, common: dict, content_metadata: dict, changes: List[str], checkpoint_dir):
    """The checkpoint holds optimizer state, in a layout this run can read."""
    if "opt_param_scheduler" not in common:
        raise CheckpointingException(
            f"{checkpoint_dir} holds no optimizer state (it was saved with --no-save-optim); pass "
            "--no-load-optim to start the optimizer and learning-rate schedule afresh from its weights"
        )
    _check_optimizer_layout(args, content_metadata, changes, checkpoint_dir)


def _check_optimizer_layout(args, content_metadata: dict, changes: List[str], checkpoint_dir) -> None:
    """Refuse, before anything is read, a distributed-optimizer layout that cannot follow this run's model layout
    (``changes``, from :func:`_bucket_layout_changes`; every rank decides alike, so no rank is left waiting)."""
    from megatron.core.optimizer.distrib_optimizer_layouts import BUCKET_SPACE_LAYOUTS

    sharding_type = content_metadata.get("distrib_optim_sharding_type")
    if args.use_distributed_optimizer and changes and sharding_type in BUCKET_SPACE_LAYOUTS:
        raise CheckpointingException(
            f"{checkpoint_dir}: its distributed-optimizer state is in the {sharding_type} layout, which reloads only "
            f"with the model layout it was saved with (at any data-parallel size), and this run's differs "
            f"({'; '.join(changes)}). Run with the checkpoint's settings, or load it at its own layout and save with "
            "--dist-ckpt-optim-fully-reshardable (the fully_reshardable layout reloads at any layout), or pass "
            "--no-load-optim to start the optimizer afresh"
        )


def generate_state_dict(
    args,
    model,
    optimizer,
    opt_param_scheduler,
    rng_state,
    iteration=None,
    optim_sd_kwargs=None,
    model_sd_kwargs=None,
    rerun_state=None,
):
    """The checkpoint's content: arguments and version, the model chunk(s), unless --no-save-optim the optimizer
    and scheduler, the rerun state machine's entry and unless --no-save-rng the RNG state. For ``torch_dist`` the
    model and optimizer give their sharded state; for the plain formats (``torch``, ``torch_dcp``) their
    ``state_dict_for_save_checkpoint()`` / ``state_dict()``.

    The wrappers (DDP, Float16Module) hand through to the model's own sharded_state_dict; DDP first completes a
    pending distributed-optimizer parameter gather, so the weights read are this step's.
    """
    state_dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION}
    if iteration is not None:
        state_dict["iteration"] = iteration
    plain = args.ckpt_format in PLAIN_FORMATS
    for index, chunk in enumerate(model):
        state_dict[_model_key(index, len(model))] = (
            chunk.state_dict_for_save_checkpoint() if plain else chunk.sharded_state_dict(**(model_sd_kwargs or {}))
        )
    if not args.no_save_optim:
        if optimizer is not None and plain:
            state_dict["optimizer"] = optimizer.state_dict()
        elif optimizer is not None:
            # The optimizer's sharded entries are keyed by the model's sharded tensors, so it needs them.
            model_state = {key: value for key, value in state_dict.items() if key.startswith("model")}
            state_dict["optimizer"] = optimizer.sharded_state_dict(model_state, **(optim_sd_kwargs or {}))
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    state_dict["rerun_state_machine"] = rerun_state
    if not args.no_save_rng and rng_state:
        state_dict["rng_state"] = rng_state
    return state_dict


def _drop_rank_specific_args(common_state_dict):
    """The arguments legitimately differ per rank (rank, local_rank); rank 0's copy is the one saved."""
    return {key: value for key, value in common_state_dict.items() if key != "args"}


def save_checkpoint(
    iteration,
    model,
    optimizer,
    opt_param_scheduler,
    num_floating_point_operations_so_far,
    checkpointing_context=None,
    pipeline_rank=None,
    expert_rank=None,
    tensor_rank=None,
    pipeline_parallel=None,
    expert_parallel=None,
    non_persistent_ckpt=False,
    train_data_iterator=None,
    preprocess_common_state_dict_fn=None,
    release=False,
    tp_group: Optional[ProcessGroup] = None,
    pp_group: Optional[ProcessGroup] = None,
    dp_cp_group: Optional[ProcessGroup] = None,
    dp_group: Optional[ProcessGroup] = None,
    expt_dp_group: Optional[ProcessGroup] = None,
    rng_state_key_prefix: str = "",
):
    """Save to ``<save>/iter_<iteration>`` (``release/`` with ``release``) and, once every rank's data is durable,
    point the tracker at it.

    With ``--async-save`` the tensors are staged now and written in the background; the tracker moves only when
    :func:`maybe_finalize_async_saves` sees every rank finished. A crash at any moment leaves the previous
    checkpoint "latest". ``non_persistent_ckpt`` saves to ``--non-persistent-global-ckpt-dir`` (default
    ``<save>/non_persistent``) and deletes the older non-persistent checkpoints there. ``checkpointing_context``
    (a dict) keeps the save strategy from one save to the next. ``train_data_iterator`` goes to the rerun state
    machine; ``preprocess_common_state_dict_fn`` prepares the common state for the cross-rank consistency check
    (default: without the per-rank arguments); the groups default to parallel_state's and
    ``rng_state_key_prefix`` prefixes the RNG state's key. ``pipeline_rank``, ``tensor_rank``, ``expert_rank``,
    ``pipeline_parallel`` and ``expert_parallel`` name the files of Megatron's legacy per-rank format, which this
    project does not write (the distributed format has one directory for all ranks); ``expt_dp_group`` is not
    needed either: the optimizer knows the groups of its expert parameters.
    """
    import torch.distributed as dist

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training.global_vars import get_args

    # Progress is printed by the rank that prints the training and validation lines, so events stay in order.
    from megatron.training.utils import print_rank_last

    args = get_args()
    tp_group, pp_group, dp_cp_group, dp_group = _groups(tp_group, pp_group, dp_cp_group, dp_group)
    if args.ckpt_format in PLAIN_FORMATS + (FSDP_DTENSOR,):
        groups = (tp_group, pp_group, dp_cp_group, dp_group)
        plain_options = dict(release=release, non_persistent=non_persistent_ckpt, data_iterator=train_data_iterator)
        flops = num_floating_point_operations_so_far
        return _save_plain(args, iteration, model, optimizer, opt_param_scheduler, flops, groups, **plain_options)
    save_dir = args.save
    if non_persistent_ckpt:
        if getattr(args, "non_persistent_ckpt_type", "global") not in (None, "global"):
            raise ValueError(
                f"not supported yet: --non-persistent-ckpt-type {args.non_persistent_ckpt_type} "
                "(only 'global' non-persistent checkpoints)"
            )
        save_dir = getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(args.save, "non_persistent")
    checkpoint_dir = get_checkpoint_name(save_dir, iteration, release, return_base_dir=True)
    print_rank_last(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch_dist format")
    content_metadata = _content_metadata(args)
    rng_state = (
        None
        if args.no_save_rng
        else get_rng_state("torch_dist", tp_group, pp_group, dp_cp_group, dp_group, key_prefix=rng_state_key_prefix)
    )
    state_dict = generate_state_dict(
        args,
        model,
        optimizer,
        opt_param_scheduler,
        rng_state,
        iteration=iteration,
        optim_sd_kwargs={"metadata": content_metadata},
        model_sd_kwargs={"metadata": content_metadata},
        rerun_state=get_rerun_state_machine().state_dict(train_data_iterator, "torch_dist"),
    )
    state_dict["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    context = checkpointing_context if checkpointing_context is not None else {}
    strategy = context.get("save_strategy")
    if strategy is None:
        strategy = get_default_save_sharded_strategy()
        if args.ckpt_fully_parallel_save:
            strategy = FullyParallelSaveStrategyWrapper(strategy, dp_cp_group)  # replicas share the writing
        context["save_strategy"] = strategy
    if dist.get_rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
    dist.barrier()  # save() needs the directory on every rank

    def mark_latest():
        if dist.get_rank() == 0:
            write_tracker_atomically(save_dir, RELEASE_DIRNAME if release else iteration)
            if non_persistent_ckpt:
                cleanup_old_non_persistent_checkpoint(save_dir, leave_ckpt_num=1)
            elif not release:
                for directory in remove_incomplete_checkpoints(save_dir, iteration):
                    print(f"  removed incomplete checkpoint {directory} (left by an interrupted save)", flush=True)
        dist.barrier()  # nobody returns before the tracker moved

    request = dist_checkpointing.save(
        state_dict,
        checkpoint_dir,
        strategy,
        async_sharded_save=args.async_save,
        preprocess_common_before_consistancy_check=preprocess_common_state_dict_fn or _drop_rank_specific_args,
        content_metadata=content_metadata,
    )
    if args.async_save:
        request.add_finalize_fn(mark_latest)
        _async_calls().schedule_async_request(request)
    else:
        dist.barrier()
        mark_latest()
        print_rank_last(f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir}")


def _save_plain(
    args, iteration, model, optimizer, opt_param_scheduler, flops, groups, *, release, non_persistent, data_iterator
):
    """save_checkpoint in the ``torch``, ``torch_dcp`` or ``fsdp_dtensor`` format (see plain_checkpointing)."""
    if non_persistent:
        raise ValueError(
            f"not supported yet: non-persistent checkpoints with --ckpt-format {args.ckpt_format} (Megatron-LM "
            "writes them in the torch_dist format); use --ckpt-format torch_dist"
        )
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training.utils import print_rank_last

    print_rank_last(f"saving checkpoint at iteration {iteration:7d} to {args.save} in {args.ckpt_format} format")
    rng_state = None if args.no_save_rng else get_rng_state(args.ckpt_format, *groups)
    rerun_state = get_rerun_state_machine().state_dict(data_iterator, args.ckpt_format)
    build = fsdp_dtensor_state_dict if args.ckpt_format == FSDP_DTENSOR else generate_state_dict
    state_dict = build(args, model, optimizer, opt_param_scheduler, rng_state, iteration, rerun_state=rerun_state)
    state_dict["num_floating_point_operations_so_far"] = flops
    save_plain_checkpoint(args, state_dict, iteration, release, optimizer, groups[3])
    print_rank_last(f"  successfully saved checkpoint from iteration {iteration:7d} to {args.save}")


# The torch_dist load builds its template with every part, as sharded state, whatever this run saves.
_SHARDED_LOAD_TEMPLATE = {"no_save_optim": False, "no_save_rng": False, "ckpt_format": "torch_dist"}


def load_checkpoint(
    ddp_model,
    optimizer,
    opt_param_scheduler,
    load_arg="load",
    strict=True,
    checkpointing_context=None,
    skip_load_to_model_and_opt=False,
    tp_group: Optional[ProcessGroup] = None,
    pp_group: Optional[ProcessGroup] = None,
    dp_cp_group: Optional[ProcessGroup] = None,
    dp_group: Optional[ProcessGroup] = None,
    expt_dp_group: Optional[ProcessGroup] = None,
    rng_state_key_prefix: str = "",
):
    """Resume the model chunks ``ddp_model`` (and unless told otherwise the optimizer, scheduler, RNG and rerun
    state) from ``args.<load_arg>`` (or ``--pretrained-checkpoint``); returns (iteration, floating-point
    operations so far). A missing checkpoint starts fresh, or exits with ``--exit-on-missing-checkpoint``; an
    incomplete or corrupt one raises, naming the directory.

    ``strict`` makes missing model keys an error; ``skip_load_to_model_and_opt`` reads everything but leaves the
    model and optimizer as they are (for states loaded in place); ``checkpointing_context`` (a dict) keeps the load
    strategy between loads; the groups default to parallel_state's (``expt_dp_group``: see save_checkpoint) and
    ``rng_state_key_prefix`` must match the save's.
    """
    from megatron.core.dist_checkpointing.checksums import verification
    from megatron.training.global_vars import get_args

    # Every file read below is checked against its checksums unless --no-ckpt-verify.
    with verification(getattr(get_args(), "ckpt_verify", True)):
        return _load_checkpoint(
            ddp_model,
            optimizer,
            opt_param_scheduler,
            load_arg,
            strict,
            checkpointing_context,
            skip_load_to_model_and_opt,
            (tp_group, pp_group, dp_cp_group, dp_group),
            rng_state_key_prefix,
        )


def _load_checkpoint(
    ddp_model,
    optimizer,
    opt_param_scheduler,
    load_arg,
    strict,
    checkpointing_context,
    skip_load_to_model_and_opt,
    groups,
    rng_state_key_prefix,
):
    import torch.distributed as dist

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.num_microbatches_calculator import update_num_microbatches
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training.global_vars import get_args
    from megatron.training.utils import print_rank_0

    args = get_args()
    tp_group, pp_group, dp_cp_group, dp_group = _groups(*groups)
    load_dir = getattr(args, load_arg)
    found, finetune = _find_checkpoint(args, load_dir)
    if found is None:
        return _start_without_checkpoint(args, ddp_model, optimizer, load_arg, load_dir)
    checkpoint_dir, iteration, release = found
    ckpt_format = format_to_load(args, checkpoint_dir)
    if ckpt_format in PLAIN_FORMATS + (FSDP_DTENSOR,):
        groups = (tp_group, pp_group, dp_cp_group, dp_group)
        options = dict(finetune=finetune, strict=strict, skip_load_to_model_and_opt=skip_load_to_model_and_opt)
        return _load_plain(ckpt_format, args, ddp_model, optimizer, opt_param_scheduler, found, groups, **options)
    common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
    set_checkpoint_version(common.get("checkpoint_version", 0))
    fix_query_key_value_ordering(ddp_model, get_checkpoint_version())
    # The checkpoint's own layout flags build the state to load into.
    content_metadata = _checkpoint_content_metadata(common, args)
    saved_args = common.get("args")
    same_layout = saved_args is not None and (
        saved_args.tensor_model_parallel_size == dist.get_world_size(tp_group)
        and saved_args.pipeline_model_parallel_size == dist.get_world_size(pp_group)
    )
    load_optimizer = not (args.no_load_optim or finetune or release)
    if load_optimizer and optimizer is not None:
        sizes = dist.get_world_size(tp_group), dist.get_world_size(pp_group)
        changes = _bucket_layout_changes(saved_args, args, *sizes)
        _check_optimizer_loadable(args, common, content_metadata, changes, checkpoint_dir)
    load_rng = not (args.no_load_rng or finetune or release) and same_layout
    if not (args.no_load_rng or finetune or release) and not same_layout:
        print_rank_0("  the checkpoint's tensor/pipeline layout differs from this run's: RNG state not restored")
    # Its per-rank entries exist only for the saving (pipeline, tensor) layout, as for the RNG state.
    load_rerun_state = isinstance(common.get("rerun_state_machine"), dict) and same_layout and not (finetune or release)
    print_rank_0(f" loading checkpoint from {load_dir} at iteration {iteration}")
    rng_template = (
        get_rng_state("torch_dist", tp_group, pp_group, dp_cp_group, dp_group, key_prefix=rng_state_key_prefix)
        if load_rng
        else None
    )
    # What to load is decided above, whatever the --no-save-* flags say.
    template_args = argparse.Namespace(**{**vars(args), **_SHARDED_LOAD_TEMPLATE})
    sharded = generate_state_dict(
        template_args,
        ddp_model,
        optimizer if load_optimizer else None,
        None,
        rng_template,
        optim_sd_kwargs={"is_loading": True, "metadata": content_metadata},
        model_sd_kwargs={"metadata": content_metadata},
        rerun_state=get_rerun_state_machine().state_dict(None, "torch_dist") if load_rerun_state else None,
    )
    context = checkpointing_context if checkpointing_context is not None else {}
    strategy = context.get("load_strategy") or get_default_load_sharded_strategy(checkpoint_dir)
    context["load_strategy"] = strategy
    state_dict = dist_checkpointing.load(
        sharded, checkpoint_dir, strategy, strict="assume_ok_unexpected" if strict else "log_all"
    )
    if not skip_load_to_model_and_opt:
        for i, chunk in enumerate(ddp_model):
            chunk.load_state_dict(state_dict[_model_key(i, len(ddp_model))], strict=strict)
    if load_optimizer:
        if not skip_load_to_model_and_opt:
            optimizer.load_state_dict(state_dict["optimizer"])
        if opt_param_scheduler is not None:
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    elif (args.fp16 or args.bf16) and optimizer is not None and not skip_load_to_model_and_opt:
        optimizer.reload_model_params()  # fp32 main parameters follow the loaded weights
    if load_rerun_state:
        get_rerun_state_machine().load_state_dict(state_dict["rerun_state_machine"])
    if load_rng:
        restore_rng_state(state_dict["rng_state"], dp_group)
    if finetune or release:
        iteration = 0
    elif saved_args is not None:
        args.consumed_train_samples = getattr(saved_args, "consumed_train_samples", 0)
        args.consumed_valid_samples = getattr(saved_args, "consumed_valid_samples", 0)
        update_num_microbatches(consumed_samples=args.consumed_train_samples, consistency_check=False)
    set_loaded_iteration(iteration)
    dist.barrier()
    print_rank_0(
        f"  successfully loaded checkpoint from {load_dir} [ t {parallel_state.get_tensor_model_parallel_rank()}, "
        f"p {parallel_state.get_pipeline_model_parallel_rank()} ] at iteration {iteration}"
    )
    return iteration, common.get("num_floating_point_operations_so_far", 0) if not finetune else 0


def _find_checkpoint(args, load_dir):
    """(the checkpoint to load as find_checkpoint_to_load gives it, or None; whether it is a fine-tuning start):
    --load's, else --pretrained-checkpoint's (loaded as with --finetune)."""
    from megatron.training.utils import is_rank0

    if load_dir is not None and is_rank0():  # one rank lists the directory: it may hold thousands of files
        for line in describe_incomplete_checkpoints(load_dir):
            print(line, flush=True)
    found = find_checkpoint_to_load(load_dir, args.ckpt_step) if load_dir is not None else None
    if found is None and args.pretrained_checkpoint is not None:
        return find_checkpoint_to_load(args.pretrained_checkpoint), True
    return found, args.finetune


def _load_plain(ckpt_format, args, ddp_model, optimizer, opt_param_scheduler, found, groups, **options):
    """load_checkpoint for a ``torch`` or ``torch_dcp`` checkpoint (see plain_checkpointing)."""
    import torch.distributed as dist

    from megatron.training.utils import print_rank_0

    checkpoint_dir, iteration, release = found
    print_rank_0(f" loading {ckpt_format} checkpoint from {checkpoint_dir} at iteration {iteration}")
    state_dict = read_plain_checkpoint(
        ckpt_format,
        args,
        checkpoint_dir,
        iteration,
        release,
        ddp_model,
        optimizer,
        opt_param_scheduler,
        get_rng_state(ckpt_format, *groups),
        options["finetune"],
    )
    set_checkpoint_version(state_dict.get("checkpoint_version", 0))
    fix_query_key_value_ordering(ddp_model, get_checkpoint_version())
    iteration, flops = apply_plain_checkpoint(
        ckpt_format,
        state_dict,
        args,
        ddp_model,
        optimizer,
        opt_param_scheduler,
        checkpoint_dir=checkpoint_dir,
        iteration=iteration,
        release=release,
        dp_group=groups[3],
        **options,
    )
    set_loaded_iteration(iteration)
    dist.barrier()
    print_rank_0(f"  successfully loaded {ckpt_format} checkpoint from {checkpoint_dir} at iteration {iteration}")
    return iteration, flops


def _start_without_checkpoint(args, ddp_model, optimizer, load_arg, load_dir):
    """load_checkpoint's (iteration, FLOPs) = (0, 0) when there is no Megatron checkpoint: the weights of a Hugging
    Face model directory when --load names one, else a fresh start (or an exit with --exit-on-missing-checkpoint)."""
    import torch.distributed as dist

    from megatron.training.utils import print_rank_0

    if hugging_face_load_dir(args, load_arg) is not None:
        load_hf_checkpoint(ddp_model, optimizer, hugging_face_load_dir(args, load_arg))
        set_loaded_iteration(0)
        dist.barrier()
        return 0, 0
    if args.exit_on_missing_checkpoint:
        raise CheckpointingException(
            f"--exit-on-missing-checkpoint: no checkpoint in {load_dir} "
            f"({get_checkpoint_tracker_filename(load_dir)} not found)"
        )
    print_rank_0(f"WARNING: could not find a checkpoint in {load_dir}; training from scratch")
    return 0, 0


@public_api("megatron.training.utils.common_utils")
def check_adlr_autoresume_termination(iteration, model, optimizer, opt_param_scheduler) -> None:
    """With ADLR autoresume, when the cluster asks for termination: save, request a resume and exit."""
    import torch.distributed as dist

    from megatron.training.global_vars import get_adlr_autoresume, get_args
    from megatron.training.utils import is_rank0, print_rank_0

    args = get_args()
    autoresume = get_adlr_autoresume()
    dist.barrier()
    if autoresume is None or not autoresume.termination_requested():
        return
    if args.save:
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far)
        finalize_async_saves()
    print_rank_0(">>> autoresume termination request found!")
    if is_rank0():
        autoresume.request_resume()
    print_rank_0(">>> training terminated. Returning")
    raise SystemExit(0)
