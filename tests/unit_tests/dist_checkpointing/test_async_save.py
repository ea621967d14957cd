"""Asynchronous save: staged copies, a background write that does not block, finalisation only when all ranks are
done, the same checkpoint as a synchronous save, and failures reported everywhere."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from megatron.core.dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor, load, save
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    TemporalAsyncCaller,
)
from tests.unit_tests.test_utilities import run_distributed


def _state(rank, world_size):
    torch.manual_seed(0)
    full = torch.randn(8, 6)
    flat = full[4:].flatten()
    flat_range = slice(0, 11) if rank == 0 else slice(11, 24)
    return {
        "split": ShardedTensor.from_rank_offsets("split", full[4 * rank : 4 * rank + 4].clone(), (0, rank, world_size)),
        "replicated": ShardedTensor.from_rank_offsets("replicated", full[0].clone(), replica_id=rank),
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", flat[flat_range].clone(), (4, 6), flattened_range=flat_range
        ),
        "object": ShardedObject("object", {"rank": rank}, (world_size,), (rank,)),
        "step": 11,
    }


def _save_sync_and_async(sync_dir, async_dir):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    save(_state(rank, world_size), sync_dir)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(_state(rank, world_size), async_dir, async_sharded_save=True))
    queue.close()
    return True


def _layout(checkpoint_dir):
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    chunks = {
        key: [(tuple(c.offsets), tuple(c.sizes)) for c in getattr(entry, "chunks", [])]
        for key, entry in metadata.state_dict_metadata.items()
    }
    files = {
        (index.fqn, tuple(index.offset or ())): info.relative_path for index, info in metadata.storage_data.items()
    }
    return chunks, files


def test_async_save_writes_the_same_checkpoint_as_sync_save(tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    sync_dir.mkdir(), async_dir.mkdir()
    assert run_distributed(2, _save_sync_and_async, str(sync_dir), str(async_dir)) == [True, True]
    assert sorted(p.name for p in sync_dir.iterdir()) == sorted(p.name for p in async_dir.iterdir())
    assert _layout(sync_dir) == _layout(async_dir)
    for checkpoint_dir in (sync_dir, async_dir):
        request = _state(0, 2)
        request["split"] = ShardedTensor.from_rank_offsets("split", torch.zeros(8, 6))
        request["flat"] = ShardedTensor.from_rank_offsets("flat", torch.zeros(4, 6))
        request["object"] = ShardedObject("object", None, (2,), (1,))
        loaded = load(request, checkpoint_dir, validate_access_integrity=False)
        torch.manual_seed(0)
        full = torch.randn(8, 6)
        assert torch.equal(loaded["split"], full) and torch.equal(loaded["flat"], full[4:])
        assert torch.equal(loaded["replicated"], full[0]) and loaded["object"] == {"rank": 1}


def _wait_for(path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_training_continues_while_the_write_runs_and_the_save_keeps_the_staged_values(tmp_path, monkeypatch, worker):
    # Files, not events, coordinate with the writer: with worker="process" it runs in a forked child.
    writing, release = tmp_path / "writing", tmp_path / "release"
    checkpoint_dir = tmp_path / "checkpoint"
    checkpoint_dir.mkdir()
    original = torch_strategy._StagedDataPlanner.resolve_data

    def blocked_resolve(self, item):
        writing.touch()
        _wait_for(release)
        return original(self, item)

    monkeypatch.setattr(torch_strategy._StagedDataPlanner, "resolve_data", blocked_resolve)
    weights = torch.ones(64, 64)
    order = []
    request = save({"w": ShardedTensor.from_rank_offsets("w", weights)}, checkpoint_dir, async_sharded_save=True)
    request.add_finalize_fn(lambda: order.append(("latest", (checkpoint_dir / "metadata.json").exists())))
    queue = AsyncCallsQueue()
    queue.worker = worker
    queue.schedule_async_request(request)
    _wait_for(writing)

    # The "training step" runs and updates the weights in place while the writer is stuck mid-write.
    weights.add_(1.0)
    weights.copy_(weights @ torch.eye(64))
    assert queue.maybe_finalize_async_calls(no_dist=True) == []
    assert queue.get_num_unfinalized_calls() == 1 and not (checkpoint_dir / "metadata.json").exists()

    release.touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert order == [("latest", True)]  # the "latest" marker runs after metadata.json exists
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 64))}, checkpoint_dir)
    assert torch.equal(loaded["w"], torch.ones(64, 64))


def _async_save_with_failing_writer_on_rank_one(checkpoint_dir):
    rank = dist.get_rank()
    original = FileSystemWriter.write_data
    finalized = []

    def failing_write(self, plan, planner):
        raise OSError("No space left on device")

    if rank == 1:
        FileSystemWriter.write_data = failing_write
    try:
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, 2))}
        request = save(state, checkpoint_dir, async_sharded_save=True)
        request.add_finalize_fn(lambda: finalized.append("latest"))
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        try:
            queue.maybe_finalize_async_calls(blocking=True)
        except CheckpointingException as error:
            return str(error), finalized
        return None, finalized
    finally:
        FileSystemWriter.write_data = original


def test_a_failed_background_write_is_raised_on_every_rank_and_nothing_is_marked_complete(tmp_path):
    results = run_distributed(2, _async_save_with_failing_writer_on_rank_one, str(tmp_path))
    for message, finalized in results:
        assert message is not None and "writing the shards of" in message and "failed on rank(s) 1" in message
        assert "No space left on device" in message and finalized == []
    assert not (tmp_path / "metadata.json").exists() and not (tmp_path / ".metadata").exists()


def _raising_async_call_on_rank_zero():
    def work():
        if dist.get_rank() == 0:
            raise ValueError("background failure")

    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(work, (), [lambda: None]))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as error:
        return str(error)
    return None


def test_an_exception_escaping_an_async_call_is_raised_on_every_rank():
    for message in run_distributed(2, _raising_async_call_on_rank_zero):
        assert "asynchronous checkpoint write (call 0) failed on rank(s) 0" in message
        assert "background failure" in message


def test_unknown_worker_and_persistent_caller():
    queue = AsyncCallsQueue()
    queue.worker = "fiber"
    with pytest.raises(ValueError, match="worker='fiber' must be 'process' or 'thread'"):
        queue.schedule_async_request(AsyncRequest(None, (), []))
    with pytest.raises(ValueError, match=r"not supported yet: a persistent background writer \(persistent=True\)"):
        AsyncCallsQueue(persistent=True)
    with pytest.raises(ValueError, match="not supported yet: a persistent background writer"):
        AsyncCallsQueue.warmup_persistent_caller(0)


def _kill_myself(_):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_process_that_dies_is_reported():
    queue = AsyncCallsQueue()
    queue.worker = "process"
    queue.schedule_async_request(AsyncRequest(_kill_myself, (None,), [lambda: None]))
    with pytest.raises(CheckpointingException, match=r"background writer process \d+ died \(wait status 9\)"):
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)


def test_a_scheduled_request_is_frozen():
    queue = AsyncCallsQueue()
    request = AsyncRequest(None, (), [])
    queue.schedule_async_request(request)
    with pytest.raises(CheckpointingException, match="cannot add a finalize function to a frozen"):
        request.add_finalize_fn(lambda: None)
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_temporal_async_caller_runs_one_call_and_reports_it_done(tmp_path, worker):
    release = tmp_path / "release"
    caller = TemporalAsyncCaller()
    caller.worker = worker
    request = AsyncRequest(_wait_then_return, (str(release),), [])
    caller.schedule_async_call(request)
    assert not caller.is_current_async_call_done(no_dist=True)
    release.touch()
    assert caller.is_current_async_call_done(blocking=True, no_dist=True)
    assert request.async_fn_result == "written" and caller.error is None
    caller.close()


def _wait_then_return(release):
    _wait_for(Path(release))
    return "written"


def test_abort_stops_a_running_write_and_finalizes_nothing(tmp_path):
    queue = AsyncCallsQueue()
    queue.worker = "process"
    finalized = []
    queue.schedule_async_request(AsyncRequest(_wait_then_return, (str(tmp_path / "never"),), [finalized.append]))
    queue.close(abort=True)
    assert queue.get_num_unfinalized_calls() == 0 and finalized == []


def _sync_alive(alive_rank):
    return TemporalAsyncCaller().sync_all_async_calls(int(dist.get_rank() == alive_rank))


def test_sync_all_async_calls_is_true_only_when_no_rank_is_busy():
    assert run_distributed(2, _sync_alive, 1) == [False, False]
    assert run_distributed(2, _sync_alive, None) == [True, True]
