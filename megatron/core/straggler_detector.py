"""Megatron's straggler detector: which ranks are slow, and in compute or in data loading.

Public as ``megatron.core.utils.StragglerDetector`` (Megatron's path); it lives here, above the leaf helpers it uses
to synchronise the device.
"""

import logging
import time
from typing import Optional, Tuple

import torch

from megatron.core.public_api import public_api
from megatron.core.utils import get_current_device, synchronize_device

logger = logging.getLogger(__name__)


@public_api("megatron.core.utils")
class StragglerDetector:
    """Finds slow ranks: times each rank's compute (``with detector:``) and data loading
    (``with detector(bdata=True):``)
    and, at ``report()``, gathers the times of all ranks and logs the fastest and slowest on rank 0.

    Disabled (every timing a no-op) until ``configure(..., enabled=True)``. Times are wall-clock around a device
    synchronisation, so they measure the work queued inside the block. GPU telemetry (temperature, power,
    utilisation, clock) is not read: ``elapsed()`` reports 0 for those. ``port`` (Megatron's runtime on/off toggle
    server) and ``prefill`` (pre-allocated CUDA events) are accepted and not used.
    """

    def __init__(self) -> None:
        self._configured = False
        self._enabled = False
        self._world = 1
        self._rank = 0
        self.mmcnt = 1
        self.amp = 3.0
        self._bdata = False
        self._start_time: Optional[float] = None
        self.start = self.null_method
        self.stop = self.null_method
        self.reset()

    def configure(
        self,
        world: int,
        rank: int,
        mmcnt: int = 1,
        amp: float = 3.0,
        port: int = 65535,
        prefill: int = 1024,
        enabled: bool = False,
    ) -> None:
        """Set this rank's place in the world and turn timing on or off. ``mmcnt`` is how many of the fastest and
        slowest ranks are named; a rank slower than ``amp`` times the median is reported as a straggler."""
        if mmcnt < 1:
            raise ValueError(f"mmcnt must be >= 1, got {mmcnt}")
        self._world, self._rank = world, rank
        self.mmcnt = min(mmcnt, world)
        self.amp = amp
        self._enabled = enabled
        self._configured = True
        self.start = self.start_method if enabled else self.null_method
        self.stop = self.stop_method if enabled else self.null_method
        self.reset()

    @property
    def configured(self):
        return self._configured

    @property
    def enabled(self):
        return self._enabled

    @property
    def my_rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world

    def reset(self) -> None:
        """Forget the times accumulated since the last report."""
        self._compute_s = 0.0
        self._batch_s = 0.0
        self._start_time = None

    def null_method(self) -> None:
        """What start/stop are while disabled."""

    def __call__(self, bdata: bool = False):
        self._bdata = bdata
        return self

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.stop()
        self._bdata = False
        return False

    def start_method(self) -> None:
        synchronize_device()
        self._start_time = time.perf_counter()

    def stop_method(self) -> None:
        if self._start_time is None:
            raise RuntimeError("StragglerDetector stopped without being started")
        synchronize_device()
        elapsed = time.perf_counter() - self._start_time
        self._start_time = None
        if self._bdata:
            self._batch_s += elapsed
        else:
            self._compute_s += elapsed

    def elapsed(self) -> Tuple[float, float, int, int, int, int]:
        """(compute ms, data-loading ms, temperature, power, utilisation, clock) since the last call; resets."""
        compute_ms, batch_ms = self._compute_s * 1000.0, self._batch_s * 1000.0
        self.reset()
        return compute_ms, batch_ms, 0, 0, 0, 0

    def report(self, total_flops: float = 0.0, log_interval: int = 0) -> bool:
        """Gather every rank's times (a collective over the default group) and log a summary on rank 0.

        ``total_flops`` is this rank's floating-point work in the timed compute, for a per-rank TFLOP/s figure;
        ``log_interval`` is the number of iterations the times cover, for per-iteration figures. Returns True on the
        rank that logged.
        """
        if not self._enabled:
            return False
        compute_ms, batch_ms, *_ = self.elapsed()
        iterations = max(log_interval, 1)
        mine = torch.tensor([compute_ms / iterations, batch_ms / iterations, total_flops], dtype=torch.float64)
        if torch.distributed.is_initialized() and self._world > 1:
            device = get_current_device()
            gathered = [torch.zeros(3, dtype=torch.float64, device=device) for _ in range(self._world)]
            torch.distributed.all_gather(gathered, mine.to(device))
            table = torch.stack(gathered).cpu()
        else:
            table = mine.unsqueeze(0)
        if self._rank != 0:
            return False
        compute = table[:, 0]
        order = torch.argsort(compute)
        fastest = [(int(r), round(float(compute[r]), 2)) for r in order[: self.mmcnt]]
        slowest = [(int(r), round(float(compute[r]), 2)) for r in reversed(order[-self.mmcnt :])]
        tflops = [
            round(float(f) / (float(c) * iterations / 1000.0) / 1e12, 2) if c > 0 else 0.0
            for c, f in zip(compute, table[:, 2])
        ]
        median = float(compute.median())
        stragglers = [int(r) for r in range(len(compute)) if median > 0 and float(compute[r]) > self.amp * median]
        logger.info(
            "straggler report: compute ms/iter fastest (rank, ms) %s slowest %s | data-loading ms/iter max %.2f | "
            "TFLOP/s per rank min %s max %s | stragglers (> %.1fx median %.2f ms) %s",
            fastest,
            slowest,
            float(table[:, 1].max()),
            min(tflops),
            max(tflops),
            self.amp,
            median,
            stragglers,
        )
        self.last_report = {"fastest": fastest, "slowest": slowest, "stragglers": stragglers, "tflops": tflops}
        return True
