"""DistributedSignalHandler and its helpers: a signal is recorded, not fatal; every rank learns every rank's flag;
release puts the previous handler back."""

import os
import signal

import torch

from megatron.training.dist_signal_handler import DistributedSignalHandler, all_gather_item, get_device, get_world_size
from tests.unit_tests.test_utilities import run_distributed


def test_signal_is_recorded_and_release_restores_the_previous_handler():
    previous = signal.getsignal(signal.SIGUSR1)
    with DistributedSignalHandler(signal.SIGUSR1) as handler:
        assert handler.signals_received() == [False]
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.signals_received() == [True]
        assert handler.release() is True
        assert signal.getsignal(signal.SIGUSR1) is previous
        assert handler.release() is False  # already released: __exit__ does nothing more
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_single_process_helpers():
    assert get_world_size() == 1
    assert get_device() == torch.device("cpu") or torch.cuda.is_available()
    assert all_gather_item(5, torch.int64) == [5]


def _gather_flags(async_op):
    import torch.distributed as dist

    rank = dist.get_rank()
    values = all_gather_item(rank * 10, torch.int64, async_op=async_op)
    handler = DistributedSignalHandler(signal.SIGUSR2).__enter__()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR2)
    flags = handler.signals_received()
    handler.release()
    return values, flags


def test_every_rank_sees_every_ranks_flag():
    for async_op in (False, True):
        assert run_distributed(3, _gather_flags, async_op) == [([0, 10, 20], [False, True, False])] * 3
