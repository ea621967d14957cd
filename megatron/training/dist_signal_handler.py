"""SIGTERM (or another signal) turned into a clean, collective decision to save and exit.

A cluster scheduler sends SIGTERM to every rank, but not at the same instant. Each rank only records the signal;
the training loop asks :meth:`DistributedSignalHandler.signals_received` at an iteration boundary, which all-gathers
the flags, so all ranks agree to save and stop together instead of some leaving a collective half-done.
"""

import signal

import torch
import torch.distributed as dist

from megatron.core.utils import get_current_device


class DistributedSignalHandler:
    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self._received = False
        self._previous_handler = None

    def signals_received(self) -> list:
        """Every rank's flag (a list of bools, one per global rank); a collective over the world group."""
        flag = torch.tensor([int(self._received)], dtype=torch.int32, device=get_current_device())
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [bool(flag.item())]
        flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, flag)
        return [bool(f.item()) for f in flags]

    def __enter__(self):
        self._received = False
        self._previous_handler = signal.getsignal(self.sig)

        def handler(signum, frame):
            self._received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        signal.signal(self.sig, self._previous_handler)
        return False
