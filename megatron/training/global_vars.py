"""The run's global objects, as Megatron-LM keeps them: arguments, tokenizer, timers and the log writers.

``set_global_variables(args)`` (called by ``initialize_megatron`` after ``validate_args``) sets the arguments,
the micro-batch calculator, the tokenizer (which also pads the vocabulary: ``args.padded_vocab_size``), the
TensorBoard and W&B writers (on the last rank, when asked for), the timers, the exit signal handler
(``--exit-signal-handler``) and ADLR autoresume (``--adlr-autoresume``). The getters return them;
``unset_global_variables`` forgets them all (tests, or a second run in one process) and ``destroy_global_vars``
also closes the writers and puts the original signal handler back.

Two of Megatron's globals belong to NVIDIA services that are not part of this project: the one-logger telemetry
client and the NVML energy monitor (``--log-energy``). Their getters exist and return None, which is what
Megatron's return when the service is not configured.
"""

import os
import signal
import warnings

from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    init_num_microbatches_calculator,
    unset_num_microbatches_calculator,
    update_num_microbatches,
)
from megatron.core.tokenizers import build_tokenizer
from megatron.training.dist_signal_handler import DistributedSignalHandler
from megatron.training.timers import Timers

__all__ = [
    "get_args",
    "get_tokenizer",
    "get_tensorboard_writer",
    "get_wandb_writer",
    "get_timers",
    "set_args",
    "set_global_variables",
    "unset_global_variables",
    "destroy_global_vars",
    "rebuild_tokenizer",
    "get_signal_handler",
    "get_adlr_autoresume",
    "get_one_logger",
    "get_energy_monitor",
    # Megatron-LM's training code imports the micro-batch getters from here too.
    "get_num_microbatches",
    "get_current_global_batch_size",
    "update_num_microbatches",
]

_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_WANDB_WRITER = None
_GLOBAL_TIMERS = None
_GLOBAL_SIGNAL_HANDLER = None
_GLOBAL_ADLR_AUTORESUME = None


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


def get_signal_handler():
    """The ``DistributedSignalHandler`` catching ``--exit-signal`` (with ``--exit-signal-handler``); else None."""
    return _GLOBAL_SIGNAL_HANDLER


def get_adlr_autoresume():
    """The cluster's ``AutoResume`` object (``--adlr-autoresume``, when ``userlib.auto_resume`` exists); else None."""
    return _GLOBAL_ADLR_AUTORESUME


def get_one_logger():
    """Always None: NVIDIA's one-logger telemetry is not part of this project (Megatron's is None without it)."""
    return None


def get_energy_monitor():
    """Always None: the NVML energy monitor (``--log-energy``) is not part of this project."""
    return None


def rebuild_tokenizer(args):
    """Build the tokenizer again from ``args`` (e.g. after its flags changed) and make it the run's tokenizer."""
    return _build_tokenizer(args)


def set_args(args) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def set_global_variables(args, build_tokenizer: bool = True) -> None:
    """Set every global from validated ``args``; raises if they are already set (``unset_global_variables`` first).

    The arguments alone may already be set (``parse_and_validate_args`` does that); the other globals may not.
    """
    if args is None:
        raise ValueError("set_global_variables needs the validated arguments, got None")
    if _GLOBAL_TIMERS is not None or (_GLOBAL_ARGS is not None and _GLOBAL_ARGS is not args):
        raise RuntimeError("global variables are already set; call unset_global_variables() first")
    set_args(args)
    step_batch_size_schedule = getattr(args, "step_batch_size_schedule", None)
    init_num_microbatches_calculator(
        args.rank,
        rampup_batch_size=args.rampup_batch_size,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size,
        decrease_batch_size_if_needed=args.decrease_batch_size_if_needed,
        step_batch_size_schedule=step_batch_size_schedule,
        # Megatron counts the schedule's thresholds in tokens when the sequence length is known.
        seq_length=args.seq_length if step_batch_size_schedule is not None else None,
    )
    if build_tokenizer:
        _build_tokenizer(args)
    _set_tensorboard_writer(args)
    _set_wandb_writer(args)
    _set_adlr_autoresume(args)
    _set_timers(args)
    _set_signal_handler(args)


def unset_global_variables() -> None:
    """Forget every global, the micro-batch calculator included."""
    global _GLOBAL_ARGS, _GLOBAL_TOKENIZER, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_WANDB_WRITER, _GLOBAL_TIMERS
    global _GLOBAL_SIGNAL_HANDLER, _GLOBAL_ADLR_AUTORESUME
    _GLOBAL_ARGS = _GLOBAL_TOKENIZER = _GLOBAL_TENSORBOARD_WRITER = _GLOBAL_WANDB_WRITER = _GLOBAL_TIMERS = None
    _GLOBAL_SIGNAL_HANDLER = _GLOBAL_ADLR_AUTORESUME = None
    unset_num_microbatches_calculator()


def destroy_global_vars() -> None:
    """End of a run: flush and close the TensorBoard writer, restore the signal's previous handler, forget all."""
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        _GLOBAL_TENSORBOARD_WRITER.close()
    if _GLOBAL_SIGNAL_HANDLER is not None:
        _GLOBAL_SIGNAL_HANDLER.release()
    unset_global_variables()


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


def _set_adlr_autoresume(args) -> None:
    """ADLR autoresume lives in NVIDIA's cluster library ``userlib``; elsewhere the flag has no effect (one warning)."""
    global _GLOBAL_ADLR_AUTORESUME
    if not getattr(args, "adlr_autoresume", False):
        return
    try:
        from userlib.auto_resume import AutoResume
    except ImportError:
        warnings.warn(
            "--adlr-autoresume: userlib.auto_resume (NVIDIA's cluster library) is not installed; the flag has no effect"
        )
        return
    _GLOBAL_ADLR_AUTORESUME = AutoResume


def _set_signal_handler(args) -> None:
    """With --exit-signal-handler, catch the exit signal from start-up on, as Megatron-LM does: a signal that arrives
    while the job still builds its model and data is honoured at the first iteration boundary."""
    global _GLOBAL_SIGNAL_HANDLER
    if args.exit_signal_handler:
        _GLOBAL_SIGNAL_HANDLER = DistributedSignalHandler(getattr(args, "exit_signal", signal.SIGTERM)).__enter__()


def _set_timers(args) -> None:
    global _GLOBAL_TIMERS
    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)
