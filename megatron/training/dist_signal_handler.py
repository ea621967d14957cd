"""SIGTERM (or another signal) turned into a clean, collective decision to save and exit.

A cluster scheduler sends SIGTERM to every rank, but not at the same instant. Each rank only records the signal;
the training loop asks :meth:`DistributedSignalHandler.signals_received` at an iteration boundary, which all-gathers
the flags, so all ranks agree to save and stop together instead of some leaving a collective half-done.
"""

import signal

import torch
import torch.distributed as dist

from megatron.core.utils import get_current_device


def get_world_size() -> int:
    """The number of ranks of the default group, 1 before torch.distributed is initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_device(local_rank=None) -> torch.device:
    """The device collectives of the default group run on: this rank's accelerator, or the CPU under gloo."""
    if local_rank is not None and get_current_device().type != "cpu":
        return torch.device(get_current_device().type, local_rank)
    return get_current_device()


def all_gather_item(item, dtype, group=None, async_op=False, local_rank=None) -> list:
    """One Python value per rank of ``group``: ``item`` as a one-element tensor of ``dtype``, all-gathered.

    Returns ``[item]`` when there is a single rank. ``async_op`` is handed to the collective, which is waited on
    before the values are read.
    """
    if get_world_size() == 1:
        return [item]
    tensor = torch.tensor([item], dtype=dtype, device=get_device(local_rank))
    gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, tensor, group=group, async_op=async_op)
    if async_op:
        work.wait()
    return [value.item() for value in gathered]


class DistributedSignalHandler:
    """Context manager recording ``sig`` on this rank; ``signals_received`` reports every rank's flag."""

    def __init__(self, sig: signal.Signals = signal.SIGTERM):
        self.sig = sig
        self._received = False
        self._released = True
        self._previous_handler = None

    def signals_received(self) -> list:
        """Every rank's flag (a list of bools, one per global rank); a collective over the world group."""
        return [bool(flag) for flag in all_gather_item(int(self._received), dtype=torch.int32)]

    def __enter__(self):
        self._received = False
        self._released = False
        self._previous_handler = signal.getsignal(self.sig)

        def handler(signum, frame):
            self._received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.release()
        return False

    def release(self) -> bool:
        """Put the signal's previous handler back; False when it was already released."""
        if self._released:
            return False
        signal.signal(self.sig, self._previous_handler)
        self._released = True
        return True
