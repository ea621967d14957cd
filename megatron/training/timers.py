"""Megatron-LM's timers: named wall-clock timers with log levels, reported across ranks.

``timers = Timers(log_level, log_option)``; ``timers("forward-backward", log_level=1).start()`` ... ``.stop()``.
A timer whose level is above ``log_level`` is a no-op (``DummyTimer``), so fine-grained timers cost nothing unless
``--timing-log-level`` asks for them. ``log`` prints, on one rank, each timer's max, (min, max) or per-rank time in
milliseconds (``--timing-log-option``); ``write`` sends the max to a TensorBoard or W&B writer. Both gather the
times from every rank, so every rank must call them with the same names.

Start and stop wait for the accelerator (when there is one) so a timer measures finished work; on CPU there is
nothing to wait for.
"""

import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.utils import get_current_device

_MAX_LOG_LEVEL = 2
LOG_OPTIONS = ("max", "minmax", "all")
_clock = time.perf_counter  # seconds; a module attribute so tests can drive the clock


def _synchronize_device() -> None:
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def _collective_device() -> torch.device:
    """gloo gathers CPU tensors; other backends (nccl) gather on this rank's accelerator."""
    return torch.device("cpu") if dist.get_backend() == "gloo" else get_current_device()


class DummyTimer:
    """What ``Timers`` hands out for a level it does not record: start and stop do nothing."""

    name = "dummy timer"

    def start(self, barrier: bool = False) -> None:
        return

    def stop(self, barrier: bool = False) -> None:
        return

    def reset(self) -> None:
        return

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        raise RuntimeError(
            "a timer above the timing log level was asked for its time; raise --timing-log-level or lower the "
            "timer's log_level"
        )

    def active_time(self) -> float:
        return self.elapsed()


class Timer:
    """One named timer. ``barrier=True`` waits for every rank of ``set_barrier_group``'s group (default: all)."""

    def __init__(self, name: str):
        self.name = name
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._start_time = _clock()
        self._barrier_group = None

    def set_barrier_group(self, barrier_group) -> None:
        self._barrier_group = barrier_group

    def _barrier(self, barrier: bool) -> None:
        if barrier and dist.is_initialized():
            dist.barrier(group=self._barrier_group)

    def start(self, barrier: bool = False) -> None:
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started; stop it first")
        self._barrier(barrier)
        _synchronize_device()
        self._start_time = _clock()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started; start it first")
        self._barrier(barrier)
        _synchronize_device()
        elapsed = _clock() - self._start_time
        self._elapsed += elapsed
        self._active_time += elapsed
        self._started = False

    def reset(self) -> None:
        """Zero the elapsed time (the total active time is kept)."""
        self._elapsed = 0.0
        self._started = False

    def set_elapsed(self, value: float) -> None:
        """Set the elapsed time directly (seconds), e.g. to report a time measured elsewhere."""
        self._elapsed = value

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated since the last reset; a running timer keeps running."""
        running = self._started
        if running:
            self.stop(barrier=barrier)
        elapsed = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return elapsed

    def active_time(self) -> float:
        """Seconds this timer has run in total, resets included."""
        return self._active_time


class Timers:
    """The group of named timers of a run (``--timing-log-level``, ``--timing-log-option``)."""

    def __init__(self, log_level: int, log_option: str):
        if log_option not in LOG_OPTIONS:
            raise ValueError(f"timing log option {log_option!r} is not one of {LOG_OPTIONS}")
        if not 0 <= log_level <= _MAX_LOG_LEVEL:
            raise ValueError(f"timing log level must be in 0..{_MAX_LOG_LEVEL}, got {log_level}")
        self._log_level = log_level
        self._log_option = log_option
        self._timers: Dict[str, Timer] = {}
        self._log_levels: Dict[str, int] = {}
        self._dummy_timer = DummyTimer()

    def __call__(self, name: str, log_level: Optional[int] = None):
        """The timer ``name``, created at ``log_level`` (default: the finest, 2) on first use."""
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(
                    f"timer {name!r} was created with log level {self._log_levels[name]}, asked for {log_level}"
                )
            return self._timers[name]
        if log_level is None:
            log_level = _MAX_LOG_LEVEL
        if not 0 <= log_level <= _MAX_LOG_LEVEL:
            raise ValueError(f"timer {name!r}: log level must be in 0..{_MAX_LOG_LEVEL}, got {log_level}")
        if log_level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def _elapsed_on_all_ranks(self, names: List[str], reset: bool, barrier: bool) -> torch.Tensor:
        """``[world_size, len(names)]`` seconds; 0 where a rank has no such timer. A collective on every rank."""
        if barrier and dist.is_initialized():
            dist.barrier()
        local = torch.tensor(
            [self._timers[name].elapsed(reset=reset) if name in self._timers else 0.0 for name in names],
            dtype=torch.float64,
        )
        if not dist.is_initialized():
            return local.unsqueeze(0)
        local = local.to(_collective_device())
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).cpu()

    def _min_max(self, names: List[str], reset: bool, barrier: bool, normalizer: float) -> Dict[str, tuple]:
        """``name -> (min, max)`` over the ranks that ran the timer, divided by ``normalizer``."""
        times = self._elapsed_on_all_ranks(names, reset, barrier).T.tolist()
        result = {}
        for name, per_rank in zip(names, times):
            ran = [value for value in per_rank if value > 0.0]
            if ran:
                result[name] = (min(ran) / normalizer, max(ran) / normalizer)
        return result

    def get_all_timers_string(
        self, names: Optional[List[str]] = None, normalizer: float = 1.0, reset: bool = True, barrier: bool = False
    ) -> Optional[str]:
        """The report ``log`` prints (times in ms divided by ``normalizer``); None when no timer ran."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        names = list(self._timers) if names is None else list(names)
        to_ms = normalizer / 1000.0
        if self._log_option == "all":
            return self._all_ranks_string(names, reset, barrier, to_ms)
        min_max = self._min_max(names, reset, barrier, to_ms)
        if not min_max:
            return None
        if self._log_option == "max":
            lines = [f"    {(name + ' ').ljust(48, '.')}: {high:.2f}" for name, (_, high) in min_max.items()]
            return "\n".join(["max time across ranks (ms):"] + lines)
        lines = [f"    {(name + ' ').ljust(48, '.')}: ({low:.2f}, {high:.2f})" for name, (low, high) in min_max.items()]
        return "\n".join(["(min, max) time across ranks (ms):"] + lines)

    def _all_ranks_string(self, names: List[str], reset: bool, barrier: bool, to_ms: float) -> Optional[str]:
        times = self._elapsed_on_all_ranks(names, reset, barrier)
        lines = ["times across ranks (ms):"]
        for column, name in enumerate(names):
            ran = [(rank, value) for rank, value in enumerate(times[:, column].tolist()) if value > 0]
            if ran:
                lines.append(f"  {name}:")
                lines += [f"     rank {rank:2d}: {value / to_ms:.2f}" for rank, value in ran]
        return "\n".join(lines) if len(lines) > 1 else None

    def log(
        self,
        names: List[str],
        rank: Optional[int] = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Print the timers ``names`` on ``rank`` (default: the last rank). Every rank must call it."""
        report = self.get_all_timers_string(names, normalizer, reset, barrier)
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        this_rank = dist.get_rank() if dist.is_initialized() else 0
        if rank is None:
            rank = world_size - 1
        if rank == this_rank and report is not None:
            print(report, flush=True)

    def write(
        self,
        names: List[str],
        writer,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Send each timer's max over the ranks (seconds / ``normalizer``) to ``writer`` as ``<name>-time``.

        ``writer`` is a TensorBoard ``SummaryWriter`` (``add_scalar``) or the ``wandb`` module (``log``), or None on
        ranks that do not write. Every rank must call it.
        """
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        min_max = self._min_max(list(names), reset, barrier, normalizer)
        if writer is None:
            return
        for name, (_, high) in min_max.items():
            if hasattr(writer, "add_scalar"):
                writer.add_scalar(name + "-time", high, iteration)
            else:
                writer.log({name + "-time": high}, iteration)
