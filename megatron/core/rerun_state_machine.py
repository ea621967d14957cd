"""Megatron's rerun state machine: the loop that decides whether a training step's forward/backward runs again,
and the piece of every training checkpoint that records its state.

Megatron-Core uses it to re-run a step whose result failed a check (a NaN loss, a spiky loss) and attribute the
fault to a transient error, a faulty GPU or the data. This project implements the machine's default mode,
``RerunMode.DISABLED``: each step runs once, ``validate_result`` rejects a bad result (raising when the check is
fatal), and checkpoints carry the machine's state in Megatron's layout, so a checkpoint written here restores into
Megatron and the other way round. The re-running modes (``--rerun-mode validate_results`` /
``report_determinism_stats``) and error injection are refused as not supported yet.

Checkpoint layout (``state_dict``): ``{"mode": RerunMode, "sharded": ...}``; ``mode`` is common state and
``sharded`` holds the per-rank fields, as a ``ShardedObject`` keyed ``rerun_state_machine_state`` over
(pipeline, tensor) ranks, replicated over data-parallel ranks, for the ``torch_dist`` format.
"""

import logging
import os
from enum import Enum
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

import torch

logger = logging.getLogger(__name__)

# Exit codes Megatron's launchers recognise: restart to disambiguate a result, or validation failed.
EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = 17

_GLOBAL_RERUN_STATE_MACHINE: Optional["RerunStateMachine"] = None


class RerunDiagnostic(str, Enum):
    """What a re-run concluded about a suspicious result."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, Enum):
    """How the machine runs: each step once (disabled), or re-running steps to validate or measure results."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(Enum):
    """Where the machine is in the (re-)run of a step."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


def _not_supported(what: str) -> ValueError:
    return ValueError(
        f"not supported yet: re-running training steps ({what}); only the rerun state machine's default mode "
        "'disabled' is implemented (drop --rerun-mode / --error-injection-rate)"
    )


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", 0))


class RerunErrorInjector:
    """Megatron's fault injector for testing the re-run logic; only its checkpointed state exists here, and a
    non-zero ``error_injection_rate`` (which needs the re-running modes) is refused."""

    def __init__(
        self, error_injection_rate: int = 0, error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR
    ) -> None:
        if not isinstance(error_injection_type, RerunDiagnostic):
            raise ValueError(f"error_injection_type must be a RerunDiagnostic, got {error_injection_type!r}")
        if error_injection_rate:
            raise _not_supported(f"error injection, error_injection_rate={error_injection_rate}")
        self.error_injection_rate = error_injection_rate
        self.error_injection_type = error_injection_type
        self.injected_error_type: Optional[RerunDiagnostic] = None

    def state_dict(self) -> dict:
        return {
            "error_injection_rate": self.error_injection_rate,
            "error_injection_type": self.error_injection_type,
            "injected_error_type": self.injected_error_type,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["error_injection_rate"]:
            raise _not_supported(f"error injection, error_injection_rate={state_dict['error_injection_rate']}")
        self.error_injection_rate = state_dict["error_injection_rate"]
        self.error_injection_type = state_dict["error_injection_type"]
        self.injected_error_type = state_dict["injected_error_type"]


class RerunDataIterator:
    """A data iterator that can replay the micro-batches of the current step (``rewind``) or drop them and move
    on (``advance``); it records micro-batches only while the machine is in a re-running mode."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable
        self.saved_microbatches: List[Any] = []
        self.replaying = False
        self.replay_pos = 0

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError("RerunDataIterator: the re-run asked for more micro-batches than the step read")
            batch = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return batch
        batch = next(self.iterable)
        if get_rerun_state_machine().get_mode() != RerunMode.DISABLED:
            self.saved_microbatches.append(batch)
        return batch

    def rewind(self) -> None:
        self.replaying = True
        self.replay_pos = 0

    def advance(self) -> None:
        self.replaying = False
        self.saved_microbatches = []

    def state_dict(self) -> dict:
        return {
            "saved_microbatches": self.saved_microbatches,
            "replaying": self.replaying,
            "replay_pos": self.replay_pos,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.saved_microbatches = state_dict["saved_microbatches"]
        self.replaying = state_dict["replaying"]
        self.replay_pos = state_dict["replay_pos"]


DataIteratorArgType = Optional[Union[RerunDataIterator, List[RerunDataIterator]]]


class RerunStateMachine:
    """The step (re-)run controller; in ``RerunMode.DISABLED`` every step runs exactly once.

    Use in a training step::

        machine = get_rerun_state_machine()
        while machine.should_run_forward_backward(data_iterator):
            ...forward and backward...
        should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    """

    def __init__(
        self,
        state_save_func: Optional[Callable] = None,
        state_restore_func: Optional[Callable] = None,
        mode: RerunMode = RerunMode.DISABLED,
        error_injector: Optional[RerunErrorInjector] = None,
        result_rejected_tracker_filename: Optional[str] = None,
    ) -> None:
        self.set_mode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.error_injector = error_injector or RerunErrorInjector()
        self.failed_validation_call = None
        self.initial_result = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[int] = None
        self.data_iterator_checkpoints: Optional[list] = None
        self.large_value_counts: dict = {}
        self.max_values: dict = {}
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self.result_rejected_tracker_filename = result_rejected_tracker_filename

    def set_mode(self, mode: RerunMode) -> None:
        mode = RerunMode(mode)
        if mode != RerunMode.DISABLED:
            raise _not_supported(f"--rerun-mode={mode.value}")
        self.mode = mode

    def get_mode(self) -> RerunMode:
        return self.mode

    def should_run_forward_backward(self, data_iterator: DataIteratorArgType) -> bool:
        """True once per step (the step's run), then False; counts the steps in ``current_iteration``."""
        if self.state == RerunState.NOT_RUNNING_YET:
            self.state = RerunState.INITIAL_RUN
            self.current_iteration += 1
            return True
        self.state = RerunState.NOT_RUNNING_YET
        return False

    def should_checkpoint_and_exit(self) -> Tuple[bool, bool, int]:
        """(save a checkpoint now, exit now, exit code): never, without re-runs."""
        return False, False, 0

    def validate_result(
        self,
        result: Any,
        rejection_func: Callable[[Any], bool],
        message: str = "unexpected result",
        comparison_func: Optional[Callable] = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Check ``result`` (e.g. the loss) with ``rejection_func``: a rejected result raises when ``fatal``, else
        is logged. Without re-runs there is nothing to compare, so ``comparison_func`` and ``tolerance`` are not
        used."""
        if not rejection_func(result):
            return
        text = f"Rank {_rank()}, iteration {self.current_iteration}: {message} (result: {result})"
        if self.result_rejected_tracker_filename is not None:
            with open(self.result_rejected_tracker_filename, "a") as tracker:
                tracker.write(
                    f"rank={_rank()} iteration={self.current_iteration} status=rerun_disabled "
                    f"result={result} message='{message}'\n"
                )
        if fatal:
            raise RuntimeError(text)
        logger.warning(text)

    def state_dict(self, data_iterator: DataIteratorArgType, ckpt_format: str) -> dict:
        """The machine's checkpoint entry (Megatron's layout; see the module docstring)."""
        iterators = self._data_iterators(data_iterator)
        sharded = {
            "state": self.state,
            "current_iteration": self.current_iteration,
            "rerun_requested": self.rerun_requested,
            "checkpoint_requested": self.checkpoint_requested,
            "restart_again_requested": self.restart_again_requested,
            "continue_requested": self.continue_requested,
            "error_injector_checkpoint": self.error_injector.state_dict(),
            "failed_validation_call": self.failed_validation_call,
            "initial_result": self.initial_result,
            "suspicious_node": self.suspicious_node,
            "suspicious_device": self.suspicious_device,
            "data_iterator_checkpoints": [d.state_dict() for d in iterators] if iterators else None,
            "large_value_counts": self.large_value_counts,
            "max_values": self.max_values,
        }
        if ckpt_format == "torch_dist":
            from megatron.core import parallel_state
            from megatron.core.dist_checkpointing.mapping import ShardedObject

            sharded = ShardedObject(
                "rerun_state_machine_state",
                sharded,
                (
                    parallel_state.get_pipeline_model_parallel_world_size(),
                    parallel_state.get_tensor_model_parallel_world_size(),
                ),
                (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
                replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
            )
        return {"mode": self.mode, "sharded": sharded}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from a checkpoint entry. A machine disabled here, or one saved disabled, keeps its own state (as
        Megatron's does: the command line's mode wins)."""
        if self.mode == RerunMode.DISABLED or RerunMode(state_dict["mode"]) == RerunMode.DISABLED:
            return
        raise _not_supported(f"a checkpoint saved with --rerun-mode={RerunMode(state_dict['mode']).value}")

    def _data_iterators(self, data_iterator: DataIteratorArgType) -> List[RerunDataIterator]:
        if self.mode == RerunMode.DISABLED or data_iterator is None:
            return []
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        return [d for d in iterators if d is not None]


def initialize_rerun_state_machine(**kwargs) -> None:
    """Create the process's machine (``RerunStateMachine(**kwargs)``); raises when one exists."""
    global _GLOBAL_RERUN_STATE_MACHINE
    if _GLOBAL_RERUN_STATE_MACHINE is not None:
        raise RuntimeError("the rerun state machine is already initialized; destroy_rerun_state_machine() first")
    _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine(**kwargs)


def destroy_rerun_state_machine() -> None:
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = None


def get_rerun_state_machine() -> RerunStateMachine:
    """The process's machine, created in the default (disabled) mode on first use."""
    if _GLOBAL_RERUN_STATE_MACHINE is None:
        initialize_rerun_state_machine()
    return _GLOBAL_RERUN_STATE_MACHINE
