"""Training-checkpoint layout: where each iteration's checkpoint lives and which one is "latest".

``<save>/iter_0000100/`` holds the distributed checkpoint of iteration 100 (``release/`` for a release checkpoint)
and ``<save>/latest_checkpointed_iteration.txt`` holds the iteration number (or ``release``), as in Megatron-LM.
The tracker is replaced atomically and only after every rank's data is durable, so a save interrupted at any moment
leaves the previous checkpoint as "latest" and loadable; :func:`find_checkpoint_to_load` refuses an incomplete one.
"""

import os
from pathlib import Path
from typing import Optional, Tuple, Union

from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingException, maybe_load_config
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.torch import DCP_METADATA_FNAME

TRACKER_FNAME = "latest_checkpointed_iteration.txt"
RELEASE_DIRNAME = "release"


def get_checkpoint_name(checkpoints_path: Union[str, Path], iteration: int, release: bool = False) -> str:
    """``<checkpoints_path>/iter_<iteration, 7 digits>``, or ``<checkpoints_path>/release``."""
    directory = RELEASE_DIRNAME if release else f"iter_{iteration:07d}"
    return os.path.join(checkpoints_path, directory)


def get_checkpoint_tracker_filename(checkpoints_path: Union[str, Path]) -> str:
    """``<checkpoints_path>/latest_checkpointed_iteration.txt``."""
    return os.path.join(checkpoints_path, TRACKER_FNAME)


def read_metadata(tracker_filename: Union[str, Path]) -> Tuple[int, bool]:
    """(iteration, release) from a tracker file holding an iteration number or ``release``."""
    try:
        text = Path(tracker_filename).read_text().strip()
    except FileNotFoundError:
        raise CheckpointingException(f"checkpoint tracker {tracker_filename} does not exist") from None
    if text == RELEASE_DIRNAME:
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointingException(
            f"checkpoint tracker {tracker_filename} holds {text[:80]!r}, not an iteration number or 'release'; "
            "write the iteration of the checkpoint to resume from into it"
        ) from None
    if iteration < 0:
        raise CheckpointingException(
            f"checkpoint tracker {tracker_filename} holds the negative iteration {iteration}"
        )
    return iteration, False


def write_tracker_atomically(checkpoints_path: Union[str, Path], iteration: int) -> None:
    """Point the tracker at ``iteration``: write a temporary file, fsync it, rename it over the tracker and fsync
    the directory, so readers see the old or the new iteration and never a partial file."""
    tracker = get_checkpoint_tracker_filename(checkpoints_path)
    temporary = f"{tracker}.tmp.{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, tracker)
    directory = os.open(checkpoints_path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def find_checkpoint_to_load(
    load_dir: Union[str, Path], iteration: Optional[int] = None
) -> Optional[Tuple[str, int, bool]]:
    """(checkpoint directory, iteration, release) of the checkpoint to resume from, or None when ``load_dir`` has
    no tracker (a fresh start). ``iteration`` overrides the tracker (``--ckpt-step``). Raises, naming the directory
    and the missing files, when that checkpoint is not complete."""
    release = False
    if iteration is None:
        tracker = get_checkpoint_tracker_filename(load_dir)
        if not os.path.exists(tracker):
            return None
        iteration, release = read_metadata(tracker)
        source = f"named by {tracker}"
    else:
        source = "requested"
    checkpoint_dir = get_checkpoint_name(load_dir, iteration, release)
    what = f"checkpoint {checkpoint_dir} ({source})"
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointingException(f"{what} does not exist")
    missing = [
        name
        for name in (CONFIG_FNAME, DCP_METADATA_FNAME, COMMON_STATE_FNAME)
        if not os.path.exists(os.path.join(checkpoint_dir, name))
    ]
    if missing:
        raise CheckpointingException(
            f"{what} is incomplete: {', '.join(missing)} missing (its save was interrupted); resume from an earlier "
            "iteration by writing it into the tracker file, or remove the directory"
        )
    maybe_load_config(checkpoint_dir)  # raises on a corrupt metadata.json
    return checkpoint_dir, iteration, release


# ---- saving and loading a training job ---------------------------------------------------------------------------
# The functions below use the training globals (arguments, model chunks, optimizer, scheduler); everything above is
# plain path handling that tools can use without them.

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


def _rng_state_sharded_object():
    """This rank's RNG states, one object per (pipeline, tensor) rank, replicated over data-parallel ranks."""
    import random

    import numpy as np
    import torch

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import cuda_available

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": tensor_parallel.random.get_device_rng_state() if cuda_available() else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    return ShardedObject(
        "rng_state",
        [state],
        (pp_size, tp_size),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def _restore_rng_state(states) -> None:
    import random

    import numpy as np
    import torch

    from megatron.core import tensor_parallel
    from megatron.core.utils import cuda_available

    state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if cuda_available() and state["cuda_rng_state"] is not None:
        tensor_parallel.random.set_device_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _model_key(index: int, num_chunks: int) -> str:
    return "model" if num_chunks == 1 else f"model{index}"


def _sharded_state_dict(model, optimizer, opt_param_scheduler, *, with_optimizer, with_rng, is_loading, args=None,
                        iteration=None, flops=None):
    """Megatron's checkpoint content: model chunk(s), optimizer, scheduler, RNG, iteration and arguments.

    The wrappers (DDP, Float16Module) hand through to the model's own sharded_state_dict; DDP first completes a
    pending distributed-optimizer parameter gather, so the weights read are this step's.
    """
    state_dict = {_model_key(i, len(model)): chunk.sharded_state_dict() for i, chunk in enumerate(model)}
    if with_optimizer:
        state_dict["optimizer"] = optimizer.sharded_state_dict(dict(state_dict), is_loading=is_loading)
    if with_rng:
        state_dict["rng_state"] = _rng_state_sharded_object()
    if not is_loading:  # the plain values below are the checkpoint's common state (rank 0 writes them)
        state_dict.update(
            args=args,
            checkpoint_version=3.0,
            iteration=iteration,
            num_floating_point_operations_so_far=flops,
        )
        if with_optimizer and opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    return state_dict


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, non_persistent_ckpt=False):
    """Save to ``<save>/iter_<iteration>`` and, once every rank's data is durable, point the tracker at it.

    With ``--async-save`` the tensors are staged now and written in the background; the tracker moves only when
    :func:`maybe_finalize_async_saves` sees every rank finished. A crash at any moment leaves the previous
    checkpoint "latest".
    """
    import torch.distributed as dist

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core import parallel_state
    from megatron.training.global_vars import get_args
    from megatron.training.utils import print_rank_0

    args = get_args()
    checkpoint_dir = get_checkpoint_name(args.save, iteration)
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {args.save} in torch_dist format")
    state_dict = _sharded_state_dict(
        model, optimizer, opt_param_scheduler,
        with_optimizer=not args.no_save_optim, with_rng=not args.no_save_rng, is_loading=False,
        args=args, iteration=iteration, flops=num_floating_point_operations_so_far,
    )
    strategy = get_default_save_sharded_strategy()
    if args.ckpt_fully_parallel_save:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
    save_dir = args.save
    if dist.get_rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
    dist.barrier()

    def mark_latest():
        if dist.get_rank() == 0:
            write_tracker_atomically(save_dir, iteration)
        dist.barrier()

    request = dist_checkpointing.save(
        state_dict, checkpoint_dir, strategy, async_sharded_save=args.async_save,
        # The arguments legitimately differ per rank (rank, local_rank); rank 0's copy is the one saved.
        preprocess_common_before_consistancy_check=lambda common: {k: v for k, v in common.items() if k != "args"},
    )
    if args.async_save:
        request.add_finalize_fn(mark_latest)
        _async_calls().schedule_async_request(request)
    else:
        dist.barrier()
        mark_latest()
        print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {args.save}")


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Resume model (and unless told otherwise optimizer, scheduler and RNG) from ``--load``; returns
    (iteration, floating-point operations so far). A missing checkpoint starts fresh, or exits with
    ``--exit-on-missing-checkpoint``; an incomplete or corrupt one raises, naming the directory."""
    import torch.distributed as dist

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.num_microbatches_calculator import update_num_microbatches
    from megatron.training.global_vars import get_args
    from megatron.training.utils import print_rank_0

    args = get_args()
    load_dir = getattr(args, load_arg)
    finetune = args.finetune
    found = find_checkpoint_to_load(load_dir, args.ckpt_step) if load_dir is not None else None
    if found is None and args.pretrained_checkpoint is not None:
        found = find_checkpoint_to_load(args.pretrained_checkpoint)
        finetune = True
    if found is None:
        if args.exit_on_missing_checkpoint:
            raise CheckpointingException(
                f"--exit-on-missing-checkpoint: no checkpoint in {load_dir} "
                f"({get_checkpoint_tracker_filename(load_dir)} not found)"
            )
        print_rank_0(f"WARNING: could not find a checkpoint in {load_dir}; training from scratch")
        return 0, 0
    checkpoint_dir, iteration, release = found
    common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
    saved_args = common.get("args")
    same_layout = saved_args is not None and (
        saved_args.tensor_model_parallel_size == args.tensor_model_parallel_size
        and saved_args.pipeline_model_parallel_size == args.pipeline_model_parallel_size
    )
    load_optimizer = not (args.no_load_optim or finetune or release) and "opt_param_scheduler" in common
    load_rng = not (args.no_load_rng or finetune or release) and same_layout
    if not (args.no_load_rng or finetune or release) and not same_layout:
        print_rank_0("  the checkpoint's tensor/pipeline layout differs from this run's: RNG state not restored")
    print_rank_0(f" loading checkpoint from {load_dir} at iteration {iteration}")
    sharded = _sharded_state_dict(model, optimizer, opt_param_scheduler,
                                  with_optimizer=load_optimizer, with_rng=load_rng, is_loading=True)
    state_dict = dist_checkpointing.load(sharded, checkpoint_dir, strict="assume_ok_unexpected" if strict else
                                         "log_all")
    for i, chunk in enumerate(model):
        chunk.load_state_dict(state_dict[_model_key(i, len(model))], strict=strict)
    if load_optimizer:
        optimizer.load_state_dict(state_dict["optimizer"])
        if opt_param_scheduler is not None:
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    elif args.fp16 or args.bf16:
        optimizer.reload_model_params()  # fp32 main parameters follow the loaded weights
    if load_rng:
        _restore_rng_state(state_dict["rng_state"])
    if finetune or release:
        iteration = 0
    elif saved_args is not None:
        args.consumed_train_samples = getattr(saved_args, "consumed_train_samples", 0)
        args.consumed_valid_samples = getattr(saved_args, "consumed_valid_samples", 0)
        update_num_microbatches(consumed_samples=args.consumed_train_samples, consistency_check=False)
    dist.barrier()
    print_rank_0(
        f"  successfully loaded checkpoint from {load_dir} [ t {parallel_state.get_tensor_model_parallel_rank()}, "
        f"p {parallel_state.get_pipeline_model_parallel_rank()} ] at iteration {iteration}"
    )
    return iteration, common.get("num_floating_point_operations_so_far", 0) if not finetune else 0


# Model-defining arguments that --use-checkpoint-args takes from the checkpoint (Megatron-LM's list, for what exists).
_CHECKPOINT_MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type", "rotary_base",
    "rotary_percent", "rotary_interleaved", "use_rope_scaling", "swiglu", "squared_relu",
    "untie_embeddings_and_output_weights", "normalization", "norm_epsilon", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "apply_query_key_layer_scaling", "hidden_dropout", "attention_dropout", "tokenizer_type",
    "vocab_size", "make_vocab_size_divisible_by", "padded_vocab_size", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
)


def load_args_from_checkpoint(args, load_arg: str = "load"):
    """``--use-checkpoint-args``: set the model-defining arguments from the checkpoint's saved arguments.

    Called before validation, on every rank (each reads the small ``common.pt``). Values the checkpoint lacks keep
    their command-line values. Raises, naming the directory, when there is no checkpoint to take them from.
    """
    from megatron.core.dist_checkpointing import load_common_state_dict

    load_dir = getattr(args, load_arg)
    found = find_checkpoint_to_load(load_dir, getattr(args, "ckpt_step", None)) if load_dir else None
    if found is None:
        raise CheckpointingException(
            f"--use-checkpoint-args: no checkpoint to take the arguments from in {load_dir} "
            f"({get_checkpoint_tracker_filename(load_dir) if load_dir else '--load not given'})"
        )
    saved = load_common_state_dict(found[0]).get("args")
    if saved is None:
        raise CheckpointingException(f"--use-checkpoint-args: checkpoint {found[0]} holds no saved arguments")
    for name in _CHECKPOINT_MODEL_ARGS:
        if hasattr(saved, name):
            setattr(args, name, getattr(saved, name))
    return args
