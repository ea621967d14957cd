"""The run's global objects, as Megatron-LM keeps them: arguments, tokenizer, timers and the log writers.

``set_global_variables(args)`` (called by ``initialize_megatron`` after ``validate_args``) sets the arguments,
the micro-batch calculator, the tokenizer (which also pads the vocabulary: ``args.padded_vocab_size``), the
TensorBoard and W&B writers (on the last rank, when asked for) and the timers. The getters return them;
``unset_global_variables`` forgets them all (tests, or a second run in one process).
"""

import os
import warnings

from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    init_num_microbatches_calculator,
    unset_num_microbatches_calculator,
    update_num_microbatches,
)
from megatron.core.tokenizers import build_tokenizer
from megatron.training.timers import Timers

__all__ = [
    "get_args", "get_tokenizer", "get_tensorboard_writer", "get_wandb_writer", "get_timers", "set_args",
    "set_global_variables", "unset_global_variables",
    # Megatron-LM's training code imports the micro-batch getters from here too.
    "get_num_microbatches", "get_current_global_batch_size", "update_num_microbatches",
]

_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_WANDB_WRITER = None
_GLOBAL_TIMERS = None


def _ensure_initialized(value, name: str):
    if value is None:
        raise RuntimeError(f"{name} is not initialized; call set_global_variables(args) (initialize_megatron) first")
    return value


def get_args():
    """The validated arguments of this run."""
    return _ensure_initialized(_GLOBAL_ARGS, "args")


def get_tokenizer():
    """The tokenizer built from ``--tokenizer-type`` and its files."""
    return _ensure_initialized(_GLOBAL_TOKENIZER, "tokenizer")


def get_tensorboard_writer():
    """The TensorBoard ``SummaryWriter`` on the writing rank (the last) with ``--tensorboard-dir``; else None."""
    return _GLOBAL_TENSORBOARD_WRITER


def get_wandb_writer():
    """The ``wandb`` module, after ``wandb.init``, on the last rank with ``--wandb-project``; else None."""
    return _GLOBAL_WANDB_WRITER


def get_timers():
    """The run's ``Timers`` (``--timing-log-level``, ``--timing-log-option``)."""
    return _ensure_initialized(_GLOBAL_TIMERS, "timers")


def set_args(args) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def set_global_variables(args, build_tokenizer: bool = True) -> None:
    """Set every global from validated ``args``; raises if they are already set (``unset_global_variables`` first)."""
    if args is None:
        raise ValueError("set_global_variables needs the validated arguments, got None")
    if _GLOBAL_ARGS is not None:
        raise RuntimeError("global variables are already set; call unset_global_variables() first")
    set_args(args)
    init_num_microbatches_calculator(
        args.rank,
        args.rampup_batch_size,
        args.global_batch_size,
        args.micro_batch_size,
        args.data_parallel_size,
        args.decrease_batch_size_if_needed,
    )
    if build_tokenizer:
        _build_tokenizer(args)
    _set_tensorboard_writer(args)
    _set_wandb_writer(args)
    _set_timers(args)


def unset_global_variables() -> None:
    """Forget every global, the micro-batch calculator included."""
    global _GLOBAL_ARGS, _GLOBAL_TOKENIZER, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_WANDB_WRITER, _GLOBAL_TIMERS
    _GLOBAL_ARGS = _GLOBAL_TOKENIZER = _GLOBAL_TENSORBOARD_WRITER = _GLOBAL_WANDB_WRITER = _GLOBAL_TIMERS = None
    unset_num_microbatches_calculator()


def _build_tokenizer(args):
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = build_tokenizer(args)
    return _GLOBAL_TOKENIZER


def _is_last_rank(args) -> bool:
    return args.rank == args.world_size - 1


def _set_tensorboard_writer(args) -> None:
    global _GLOBAL_TENSORBOARD_WRITER
    if not args.tensorboard_dir or not _is_last_rank(args):
        return
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            f"--tensorboard-dir {args.tensorboard_dir}: the tensorboard package is not installed, so nothing is "
            "written; pip install tensorboard (or megatron-lite[logging])"
        )
        return
    print("> setting tensorboard ...", flush=True)
    _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)


def _set_wandb_writer(args) -> None:
    global _GLOBAL_WANDB_WRITER
    if not args.wandb_project or not _is_last_rank(args):
        return
    try:
        import wandb
    except ImportError:
        warnings.warn(
            f"--wandb-project {args.wandb_project}: the wandb package is not installed, so nothing is logged; "
            "pip install wandb (or megatron-lite[logging])"
        )
        return
    save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
    os.makedirs(save_dir, exist_ok=True)
    init_kwargs = {"dir": save_dir, "name": args.wandb_exp_name, "project": args.wandb_project, "config": vars(args)}
    if args.wandb_entity:
        init_kwargs["entity"] = args.wandb_entity
    wandb.init(**init_kwargs)
    _GLOBAL_WANDB_WRITER = wandb


def _set_timers(args) -> None:
    global _GLOBAL_TIMERS
    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)
