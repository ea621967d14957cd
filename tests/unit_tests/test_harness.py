"""The multi-rank harness itself: results come back per rank, failures and hangs fail promptly with the rank named."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.test_utilities import DistributedTestError, run_distributed


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), torch.get_num_threads()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    results = run_distributed(world_size, _all_reduce_rank)
    total = sum(range(world_size))
    assert results == [(r, world_size, float(total), 1) for r in range(world_size)]


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    time.sleep(600)  # rank 0 would wait forever: the harness must stop it


def test_failure_reports_rank_traceback_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(
        DistributedTestError, match=r"(?s)rank 1 failed first.*boom on purpose.*ranks \[0\] were stopped"
    ):
        run_distributed(2, _fail_on_rank_one, timeout=60)
    assert time.monotonic() - start < 30
    # The pool recovers: the next job runs normally on fresh workers.
    assert [r[0] for r in run_distributed(2, _all_reduce_rank)] == [0, 1]


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(600)
    return "done"


def test_hang_becomes_a_failure_naming_the_rank():
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] did not finish within 3 s"):
        run_distributed(2, _hang_on_rank_zero, timeout=3)


def _exit_hard():
    if dist.get_rank() == 1:
        os._exit(3)
    return "ok"


def test_dead_worker_is_reported():
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 failed first.*worker process died \(exit code 3\)"):
        run_distributed(2, _exit_hard, timeout=30)


def test_nested_function_is_rejected():
    def inner():
        return 1

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(1, inner)


def test_a_failed_process_group_start_is_retried_on_a_fresh_port(monkeypatch):
    """A port taken between choosing it and binding it makes init_process_group fail before the test runs:
    the harness starts the job again instead of reporting a failure."""
    import socket

    from tests.unit_tests import test_utilities

    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    taken_port = blocker.getsockname()[1]
    ports = iter([taken_port])
    real_free_port = test_utilities._free_port
    monkeypatch.setattr(test_utilities, "_free_port", lambda: next(ports, None) or real_free_port())
    try:
        results = run_distributed(2, _all_reduce_rank, timeout=20)
    finally:
        blocker.close()
    assert [r[0] for r in results] == [0, 1]
