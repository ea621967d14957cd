"""How many micro-batches make up the current global batch: constant, or ramped up with the samples consumed.

One process-wide calculator is set up by :func:`init_num_microbatches_calculator` and read through the getters
(``get_num_microbatches``, ``get_current_global_batch_size``, ...). With ``rampup_batch_size = [start, increment,
samples]`` the global batch size starts at ``start`` and grows by ``increment`` evenly over the first ``samples``
consumed samples until it reaches ``global_batch_size``. Each global batch must be a whole number of
``micro_batch_size x data_parallel_size`` slices, unless ``decrease_batch_size_if_needed`` rounds it down.
With ``step_batch_size_schedule = "0:768 250B:1536"`` it is 768 until 250e9 tokens (``seq_length`` given) or
samples have been consumed, then 1536.
"""

import logging
from abc import ABC, abstractmethod
from typing import List, Optional, Tuple, Union

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional["NumMicroBatchesCalculator"] = None


def _calculator() -> "NumMicroBatchesCalculator":
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError("num microbatches calculator is not initialized; call init_num_microbatches_calculator()")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_num_microbatches() -> int:
    """Number of micro-batches per data-parallel rank in the current global batch."""
    return _calculator().get()


def get_current_global_batch_size() -> int:
    """The global batch size the schedule asks for now (during ramp-up, the ramped value)."""
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    """The global batch size actually run: the current one, rounded down when decrease_batch_size_if_needed."""
    return _calculator().get_current_running_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
    """Move the ramp-up to ``consumed_samples`` (a no-op for a constant batch size)."""
    _calculator().update(consumed_samples, consistency_check, verbose)


def unset_num_microbatches_calculator() -> None:
    """Forget the calculator (Megatron's test helper)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


destroy_num_microbatches_calculator = unset_num_microbatches_calculator


def init_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]] = None,
    global_batch_size: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    data_parallel_size: Optional[int] = None,
    decrease_batch_size_if_needed: bool = False,
    step_batch_size_schedule: Optional[str] = None,
    seq_length: Optional[int] = None,
) -> None:
    """Create the process-wide calculator; raises if one exists (see reconfigure_num_microbatches_calculator).

    The global batch size is constant (``global_batch_size``), ramped up (``rampup_batch_size``) or follows
    ``step_batch_size_schedule`` (see :class:`StepBatchsizeNumMicroBatchesCalculator`; ``seq_length`` makes its
    thresholds count tokens instead of samples).
    """
    _configure_global_num_microbatches_calculator(
        rank,
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
        step_batch_size_schedule,
        seq_length,
        init=True,
        rampup_batch_size=rampup_batch_size,
    )


def reconfigure_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]] = None,
    global_batch_size: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    data_parallel_size: Optional[int] = None,
    decrease_batch_size_if_needed: bool = False,
    step_batch_size_schedule: Optional[str] = None,
    seq_length: Optional[int] = None,
) -> None:
    """Replace the process-wide calculator (e.g. for evaluation with another batch size)."""
    _configure_global_num_microbatches_calculator(
        rank,
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
        step_batch_size_schedule,
        seq_length,
        init=False,
        rampup_batch_size=rampup_batch_size,
    )


def _configure_global_num_microbatches_calculator(
    rank,
    global_batch_size,
    micro_batch_size,
    data_parallel_size,
    decrease_batch_size_if_needed=False,
    step_batch_size_schedule=None,
    seq_length=None,
    init=False,
    rampup_batch_size=None,
) -> None:
    """Megatron's parameters, plus ``rampup_batch_size``: the ramp-up Megatron 0.19 deprecated, which we still run."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if init and _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise RuntimeError(
            "num microbatches calculator is already initialized; use reconfigure_num_microbatches_calculator() "
            "or destroy_num_microbatches_calculator() first"
        )
    if rampup_batch_size is None:
        _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
            rank,
            global_batch_size,
            micro_batch_size,
            data_parallel_size,
            decrease_batch_size_if_needed,
            step_batch_size_schedule,
            seq_length,
        )
        return
    if step_batch_size_schedule is not None:
        raise ValueError(
            f"rampup_batch_size={rampup_batch_size!r} and step_batch_size_schedule={step_batch_size_schedule!r} "
            "are both set; give one batch-size schedule"
        )
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_rampup_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed
    )


def _build_num_microbatches_calculator(
    rank: int,
    global_batch_size: Optional[int],
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool,
    step_batch_size_schedule: Optional[str] = None,
    seq_length: Optional[int] = None,
) -> Union["ConstantNumMicroBatchesCalculator", "StepBatchsizeNumMicroBatchesCalculator"]:
    """A constant calculator, or one following ``step_batch_size_schedule`` (which replaces ``global_batch_size``)."""
    if step_batch_size_schedule is not None:
        calculator = StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size,
            data_parallel_size,
            decrease_batch_size_if_needed,
            rank,
            step_batch_size_schedule,
            seq_length,
        )
        if global_batch_size is not None and rank == 0:
            logger.info(
                "step batch size schedule %r replaces global batch size %d", step_batch_size_schedule, global_batch_size
            )
        return calculator
    if global_batch_size is None:
        raise ValueError("global_batch_size is None; set it (or give step_batch_size_schedule)")
    calculator = ConstantNumMicroBatchesCalculator(
        global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank
    )
    if rank == 0:
        logger.info("setting number of micro-batches to constant %d", calculator.get())
    return calculator


def _build_rampup_calculator(
    rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed
) -> "RampupBatchsizeNumMicroBatchesCalculator":
    if global_batch_size is None:
        raise ValueError("global_batch_size is None; rampup_batch_size ramps up to it, so set it")
    if len(rampup_batch_size) != 3:
        raise ValueError(
            f"rampup_batch_size must be [start batch size, batch size increment, ramp-up samples], got "
            f"{rampup_batch_size!r}"
        )
    start, increment, samples = (int(v) for v in rampup_batch_size)
    if rank == 0:
        logger.info(
            "will use batch size rampup starting from global batch size %d to global batch size %d with batch "
            "size increments %d over %d samples.",
            start,
            global_batch_size,
            increment,
            samples,
        )
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
        rank,
        start,
        increment,
        samples,
    )


def _round(batch_size: int, divisor: int) -> int:
    """``batch_size`` rounded down to a multiple of ``divisor``."""
    return (batch_size // divisor) * divisor


class NumMicroBatchesCalculator(ABC):
    """The calculator interface behind the module-level getters."""

    def __init__(self):
        self.num_micro_batches = None
        self.current_global_batch_size = None
        self.micro_batch_size = None
        self.current_running_global_batch_size = None

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        return self.current_running_global_batch_size

    @abstractmethod
    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        pass


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _running_batch_size(
    global_batch_size: int, slice_size: int, decrease: bool, micro_batch_size: int, data_parallel_size: int
) -> int:
    """The global batch size to run: rounded down to whole slices, or rejected when it is not whole."""
    if decrease:
        return _round(global_batch_size, slice_size)
    if global_batch_size % slice_size != 0:
        raise ValueError(
            f"global batch size ({global_batch_size}) is not divisible by micro batch size ({micro_batch_size}) "
            f"times data parallel size ({data_parallel_size}); change one of them or set "
            "decrease_batch_size_if_needed"
        )
    return global_batch_size


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A fixed global batch size."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
    ):
        super().__init__()
        _check_positive(
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            data_parallel_size=data_parallel_size,
        )
        slice_size = micro_batch_size * data_parallel_size
        running = _running_batch_size(
            global_batch_size, slice_size, decrease_batch_size_if_needed, micro_batch_size, data_parallel_size
        )
        if running == 0:
            raise ValueError(
                f"global batch size ({global_batch_size}) is smaller than micro batch size ({micro_batch_size}) "
                f"times data parallel size ({data_parallel_size}): no micro-batch fits"
            )
        if running != global_batch_size and rank == 0:
            logger.info(
                "decreasing batch size from %d to %d to keep divisibility by micro batch size (%d) times data "
                "parallel size (%d)",
                global_batch_size,
                running,
                micro_batch_size,
                data_parallel_size,
            )
        self.num_micro_batches = running // slice_size
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = running
        self.micro_batch_size = micro_batch_size

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        pass


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A global batch size that grows from ``start_global_batch_size`` by ``batch_size_increment`` evenly over the
    first ``ramup_samples`` samples (Megatron's spelling of the argument)."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
        start_global_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
    ):
        super().__init__()
        _check_positive(
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            data_parallel_size=data_parallel_size,
            start_global_batch_size=start_global_batch_size,
            batch_size_increment=batch_size_increment,
        )
        if ramup_samples < 0:
            raise ValueError(f"ramp-up samples must be >= 0, got {ramup_samples}")
        difference = global_batch_size - start_global_batch_size
        if difference < 0:
            raise ValueError(
                f"expected global batch size ({global_batch_size}) to be greater than or equal to the start batch "
                f"size ({start_global_batch_size})"
            )
        if difference % batch_size_increment != 0:
            raise ValueError(
                f"expected the global batch size interval ({difference}) to be divisible by the batch size "
                f"increment ({batch_size_increment})"
            )
        self.rank = rank
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.global_batch_size = global_batch_size
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        num_increments = difference // batch_size_increment
        # With nothing to ramp (start == global) the batch size is constant from the start.
        self.rampup_samples_per_increment = ramup_samples / num_increments if num_increments else float("inf")
        self.update(0, consistency_check=False)

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        if consumed_samples > self.ramup_samples:
            current = self.global_batch_size
        else:
            increments = int(consumed_samples / self.rampup_samples_per_increment)
            current = self.start_global_batch_size + increments * self.batch_size_increment
        _set_current_batch_size(self, current, consistency_check, verbose)


def _set_current_batch_size(calculator, current: int, consistency_check: bool, verbose: bool) -> None:
    """Make ``current`` a scheduled calculator's global batch size: what it runs (rounded down to whole
    ``micro_batch_size x data_parallel_size`` slices when ``decrease_batch_size_if_needed``; checked to be whole
    when ``consistency_check``) and how many micro-batches that is."""
    slice_size = calculator.micro_batch_times_data_parallel_size
    if calculator.decrease_batch_size_if_needed or consistency_check:
        running = _running_batch_size(
            current,
            slice_size,
            calculator.decrease_batch_size_if_needed,
            calculator.micro_batch_size,
            calculator.data_parallel_size,
        )
    else:
        running = current
    previous = calculator.current_global_batch_size
    calculator.current_global_batch_size = current
    calculator.current_running_global_batch_size = running
    calculator.num_micro_batches = max(running // slice_size, 1)
    if verbose and calculator.rank == 0 and previous is not None and previous != current:
        logger.info("changing global batch size from %d to %d", previous, current)


# Threshold suffixes of a step batch-size schedule ("250B" = 250e9 tokens or samples).
_SCHEDULE_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _parse_threshold(text: str, schedule: str) -> int:
    multiplier = _SCHEDULE_SUFFIXES.get(text[-1:].upper(), 1)
    number = text[:-1] if multiplier != 1 else text
    try:
        value = float(number) * multiplier
    except ValueError:
        value = -1.0
    if value < 0 or value != int(value):
        raise ValueError(
            f"step batch size schedule {schedule!r}: threshold {text!r} is not a whole non-negative number "
            "(digits with an optional K/M/B/T suffix)"
        )
    return int(value)


def parse_step_batch_size_schedule(schedule: str) -> List[Tuple[int, int]]:
    """``"0:768 250B:1536"`` -> ``[(0, 768), (250_000_000_000, 1536)]``: (threshold, global batch size) pairs,
    thresholds starting at 0 and strictly increasing."""
    steps = []
    for item in schedule.split():
        threshold, sep, batch_size = item.partition(":")
        if not sep or not batch_size.isdigit() or int(batch_size) <= 0:
            raise ValueError(
                f"step batch size schedule {schedule!r}: {item!r} is not THRESHOLD:BATCH_SIZE with a positive "
                "batch size (e.g. '0:768 250B:1536')"
            )
        steps.append((_parse_threshold(threshold, schedule), int(batch_size)))
    if not steps or steps[0][0] != 0:
        raise ValueError(
            f"step batch size schedule {schedule!r} must start at threshold 0 (e.g. '0:768 250B:1536'), so that "
            "the first batch size is defined"
        )
    thresholds = [threshold for threshold, _ in steps]
    if any(later <= earlier for earlier, later in zip(thresholds, thresholds[1:])):
        raise ValueError(f"step batch size schedule {schedule!r}: thresholds must be strictly increasing")
    return steps


class StepBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A global batch size that changes in steps: ``schedule`` is ``"THRESHOLD:BATCH_SIZE ..."`` (thresholds with
    optional K/M/B/T suffixes, the first one 0). Past each threshold of consumed tokens (``seq_length`` given:
    consumed samples x seq_length) or consumed samples, the global batch size is that entry's.

    An entry's divisibility by ``micro_batch_size x data_parallel_size`` is checked when training reaches it (a
    resumed job may run on more ranks than an early entry fits).
    """

    def __init__(
        self,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
        schedule: str,
        seq_length: Optional[int] = None,
    ) -> None:
        super().__init__()
        if decrease_batch_size_if_needed:
            # Each step's batch size is given exactly; rounding it down would silently change the schedule.
            raise ValueError(
                f"step_batch_size_schedule={schedule!r} cannot be combined with decrease_batch_size_if_needed=True; "
                "make every batch size in the schedule a multiple of micro_batch_size x data_parallel_size instead"
            )
        _check_positive(micro_batch_size=micro_batch_size, data_parallel_size=data_parallel_size)
        if seq_length is not None:
            _check_positive(seq_length=seq_length)
        self.rank = rank
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.schedule = parse_step_batch_size_schedule(schedule)
        self.seq_length = seq_length
        if rank == 0:
            unit = "tokens" if seq_length is not None else "samples"
            logger.info("global batch size follows the step schedule %s (thresholds in %s)", self.schedule, unit)
        self.update(0, consistency_check=False)

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        position = consumed_samples * self.seq_length if self.seq_length is not None else consumed_samples
        current = next(batch for threshold, batch in reversed(self.schedule) if threshold <= position)
        _set_current_batch_size(self, current, consistency_check, verbose)
