"""Saving and loading a training job in Megatron-LM's plain-state-dict formats, ``torch`` (legacy, one file per
model-parallel rank; :mod:`legacy_checkpointing`) and ``torch_dcp`` (PyTorch DCP; :mod:`dcp_checkpointing`).

Both store what ``generate_state_dict`` builds for them: the model chunks' ``state_dict_for_save_checkpoint()`` and
the optimizer's ``state_dict()`` instead of sharded state, beside the same scheduler, RNG list, rerun state machine
entry, arguments, ``checkpoint_version``, ``iteration`` and ``num_floating_point_operations_so_far`` as
``torch_dist``. :mod:`checkpointing` builds the state and dispatches here; the ``latest_checkpointed_iteration.txt``
tracker moves only after every rank's files are written, as for ``torch_dist``. Megatron FSDP's ``fsdp_dtensor``
format (:mod:`fsdp_dtensor_checkpointing`) is a DCP checkpoint too and goes the same way, with its own content.

Which format a checkpoint directory holds is read from its files. As in Megatron-LM, it is detected when
``--ckpt-format torch_dist`` (the default), ``fsdp_dtensor`` or ``--auto-detect-ckpt-format`` is given; with
``--ckpt-format torch`` or ``torch_dcp`` alone the checkpoint must be in that format.
"""

import torch.distributed as dist

from megatron.core.dist_checkpointing.checkpoint_dir import (
    RELEASE_DIRNAME,
    checkpoint_format,
    get_checkpoint_name,
    remove_incomplete_checkpoints,
    write_tracker_atomically,
)
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.training.dcp_checkpointing import load_dcp_checkpoint, save_dcp_checkpoint, stored_keys
from megatron.training.fsdp_dtensor_checkpointing import (
    FSDP_DTENSOR,
    fsdp_dtensor_template,
    is_fsdp_dtensor_checkpoint,
    load_optimizer_entries,
    publish_main_params,
)
from megatron.training.legacy_checkpointing import (
    load_distributed_optimizer_state,
    load_legacy_state_dict,
    save_legacy_checkpoint,
)

PLAIN_FORMATS = ("torch", "torch_dcp")
# With these --ckpt-format values (or --auto-detect-ckpt-format) a checkpoint in another format is loaded as found.
DETECTING_FORMATS = ("torch_dist", FSDP_DTENSOR)


def model_key(index: int, num_chunks: int) -> str:
    """``model`` for a single chunk, else ``model0``, ``model1``, ... (one per virtual pipeline stage)."""
    return "model" if num_chunks == 1 else f"model{index}"


def format_to_load(args, checkpoint_dir: str) -> str:
    """The format of the checkpoint in ``checkpoint_dir`` (a complete one, see ``find_checkpoint_to_load``); a
    format other than ``--ckpt-format`` is refused unless Megatron-LM would detect it (see the module docstring)."""
    found = checkpoint_format(checkpoint_dir) or "torch_dist"
    if found == "torch_dcp" and is_fsdp_dtensor_checkpoint(stored_keys(checkpoint_dir)):
        found = FSDP_DTENSOR
    if found != args.ckpt_format and not (args.auto_detect_ckpt_format or args.ckpt_format in DETECTING_FORMATS):
        raise CheckpointingException(
            f"checkpoint {checkpoint_dir} is in the {found} format, but --ckpt-format is {args.ckpt_format}; pass "
            f"--auto-detect-ckpt-format (or --ckpt-format {found}) to load it"
        )
    if found == FSDP_DTENSOR and not args.use_megatron_fsdp:
        raise CheckpointingException(
            f"checkpoint {checkpoint_dir} is in the fsdp_dtensor format, which holds Megatron FSDP's shards: load it "
            "with --use-megatron-fsdp (and save it with --ckpt-format torch_dist to resume without FSDP)"
        )
    return found


def restore_rng_state(states, dp_group) -> None:
    """Set Python's, NumPy's, torch's, the accelerator's and the model-parallel tracker's random states from a
    checkpoint's RNG list (this data-parallel rank's entry with --data-parallel-random-init, else the first)."""
    import random

    import numpy as np
    import torch

    from megatron.core import tensor_parallel
    from megatron.core.utils import cuda_available
    from megatron.training.global_vars import get_args

    state = states[dist.get_rank(dp_group)] if get_args().data_parallel_random_init else states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if cuda_available() and state["cuda_rng_state"] is not None:
        tensor_parallel.random.set_device_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


# ---- saving ----------------------------------------------------------------------------------------------------


def save_plain_checkpoint(args, state_dict: dict, iteration: int, release: bool, optimizer, dp_group) -> None:
    """Write ``state_dict`` (built by ``generate_state_dict`` for ``args.ckpt_format``) to ``args.save`` and, once
    every rank has written, point the tracker at it (a collective)."""
    if args.ckpt_format == "torch":
        save_legacy_checkpoint(state_dict, args.save, iteration, release, optimizer, args, dp_group)
    else:
        save_dcp_checkpoint(state_dict, get_checkpoint_name(args.save, iteration, release, return_base_dir=True))
    dist.barrier()  # every rank's files are in place before the tracker names them
    if dist.get_rank() == 0:
        write_tracker_atomically(args.save, RELEASE_DIRNAME if release else iteration)
        if not release:
            remove_incomplete_checkpoints(args.save, iteration)
    dist.barrier()


# ---- loading ---------------------------------------------------------------------------------------------------


def _loads_optimizer(args, finetune: bool, release: bool) -> bool:
    return not (args.no_load_optim or finetune or release)


def _optimizer_state_to_fill(optimizer) -> dict:
    """The optimizer's state dict with its per-parameter state created (e.g. Adam's moments), for DCP to fill."""
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        member.init_state_fn(member.optimizer, member.config)
    return optimizer.state_dict()


def _dcp_template(args, checkpoint_dir, ddp_model, optimizer, opt_param_scheduler, rng_template, finetune, release):
    """The structure to load a ``torch_dcp`` checkpoint into: this run's tensors and the entries to be read."""
    stored = stored_keys(checkpoint_dir)

    def has(prefix):
        return any(key == prefix or key.startswith(prefix + ".") for key in stored)

    scalars = ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far")
    template = {name: None for name in scalars if name in stored}
    for index, chunk in enumerate(ddp_model):
        template[model_key(index, len(ddp_model))] = chunk.state_dict_for_save_checkpoint()
    if _loads_optimizer(args, finetune, release) and has("optimizer"):
        template["optimizer"] = _optimizer_state_to_fill(optimizer)
        if opt_param_scheduler is not None and has("opt_param_scheduler"):
            template["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_template is not None and has("rng_state"):
        template["rng_state"] = rng_template
    return template


def read_plain_checkpoint(
    ckpt_format,
    args,
    checkpoint_dir,
    iteration,
    release,
    ddp_model,
    optimizer,
    opt_param_scheduler,
    rng_template,
    finetune,
) -> dict:
    """The state dict of a ``torch`` (this rank's file) or ``torch_dcp`` checkpoint (a collective for DCP);
    ``rng_template`` is this run's RNG list, the shape DCP fills."""
    if ckpt_format == "torch":
        return load_legacy_state_dict(checkpoint_dir, iteration, release)
    if ckpt_format == FSDP_DTENSOR:
        stored = stored_keys(checkpoint_dir)
        loads = _loads_optimizer(args, finetune, release)
        template = fsdp_dtensor_template(args, stored, ddp_model, optimizer, opt_param_scheduler, rng_template, loads)
        return load_dcp_checkpoint(template, checkpoint_dir)
    template = _dcp_template(
        args, checkpoint_dir, ddp_model, optimizer, opt_param_scheduler, rng_template, finetune, release
    )
    return load_dcp_checkpoint(template, checkpoint_dir)


def _load_model_chunks(state_dict, ddp_model, strict, checkpoint_dir) -> None:
    for index, chunk in enumerate(ddp_model):
        key = model_key(index, len(ddp_model))
        if key not in state_dict:
            stored = sorted(k for k in state_dict if k.startswith("model"))
            raise CheckpointingException(
                f"checkpoint {checkpoint_dir} has no {key!r} entry (it holds {stored}): it was saved with another "
                "number of virtual pipeline stages"
            )
        chunk.load_state_dict(state_dict[key], strict=strict)


def apply_plain_checkpoint(
    ckpt_format,
    state_dict,
    args,
    ddp_model,
    optimizer,
    opt_param_scheduler,
    *,
    checkpoint_dir,
    iteration,
    release,
    finetune,
    strict,
    skip_load_to_model_and_opt,
    dp_group,
):
    """Load ``state_dict`` into the model chunks, optimizer, scheduler, rerun state machine and RNGs, and take the
    consumed samples from its arguments; returns (iteration, floating-point operations so far)."""
    from megatron.core.num_microbatches_calculator import update_num_microbatches
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    # fsdp_dtensor's model entries are the optimizer's main weights, loaded in place: published below.
    fsdp = ckpt_format == FSDP_DTENSOR
    if not skip_load_to_model_and_opt and not fsdp:
        _load_model_chunks(state_dict, ddp_model, strict, checkpoint_dir)
    if _loads_optimizer(args, finetune, release) and "optimizer" in state_dict:
        legacy_distributed = ckpt_format == "torch" and args.use_distributed_optimizer
        if not skip_load_to_model_and_opt:
            if fsdp:
                load_optimizer_entries(optimizer, state_dict["optimizer"])
            else:
                optimizer.load_state_dict(state_dict["optimizer"])
            if legacy_distributed:
                load_distributed_optimizer_state(optimizer, checkpoint_dir, iteration, release, args)
        if opt_param_scheduler is not None:  # checkpoints before Megatron-LM's rename say lr_scheduler
            opt_param_scheduler.load_state_dict(state_dict.get("opt_param_scheduler", state_dict.get("lr_scheduler")))
    elif (args.fp16 or args.bf16) and optimizer is not None and not skip_load_to_model_and_opt and not fsdp:
        optimizer.reload_model_params()  # fp32 main parameters follow the loaded weights
    if fsdp and not skip_load_to_model_and_opt:
        publish_main_params(optimizer)
    if not (finetune or release) and isinstance(state_dict.get("rerun_state_machine"), dict):
        get_rerun_state_machine().load_state_dict(state_dict["rerun_state_machine"])
    if not (args.no_load_rng or finetune or release) and state_dict.get("rng_state"):
        states = state_dict["rng_state"]  # fsdp_dtensor: {this rank's (pipeline, tensor) key: the list}
        restore_rng_state(next(iter(states.values())) if isinstance(states, dict) else states, dp_group)
    flops = 0 if finetune else state_dict.get("num_floating_point_operations_so_far", 0)
    if finetune or release:
        return 0, flops
    saved_args = state_dict.get("args")
    if saved_args is not None:
        args.consumed_train_samples = getattr(saved_args, "consumed_train_samples", 0)
        args.consumed_valid_samples = getattr(saved_args, "consumed_valid_samples", 0)
        update_num_microbatches(consumed_samples=args.consumed_train_samples, consistency_check=False)
    return state_dict.get("iteration", state_dict.get("total_iters", iteration)), flops
