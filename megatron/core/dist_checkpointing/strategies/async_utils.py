"""Asynchronous checkpoint saving: write in the background, finalise only when every rank has finished.

An :class:`AsyncRequest` is a function that writes already-staged data (``async_fn``) plus the functions that
finalise the checkpoint once the writes of *all* ranks are done (``finalize_fns``: the DCP ``.metadata``, then
``metadata.json``, then e.g. the training loop's "latest" tracker); what ``async_fn`` returns is kept in
``async_fn_result`` for them. :class:`AsyncCallsQueue` runs each ``async_fn`` in the background and, from the
training loop, :meth:`AsyncCallsQueue.maybe_finalize_async_calls` agrees with the other ranks (one small all-reduce
per pending request) on which requests have finished everywhere and runs their finalize functions on every rank.

The background worker is a forked **process** by default (as in Megatron-LM), or a **thread**. Why a process: the
write is mostly ``torch.save`` serialisation (zip records, CRC32, copies into the file object), parts of which hold
the GIL; a writer thread then delays every return of the training thread into Python, e.g. after each collective
(measured on CPU: a 2-int all-reduce poll takes ~2 ms with a writer thread running, ~0.2 ms with a writer process).
The forked child sees the staged tensors without a copy (copy-on-write), writes its files, sends its result back
through a pipe and exits; it takes part in no collective. ``worker="thread"`` remains for platforms without
``fork``; ``benchmarks/bench_checkpoint.py`` measures the training stall with both.

Every rank must call ``maybe_finalize_async_calls`` the same number of times (e.g. once per training iteration),
because each call takes part in a collective.
"""

import logging
import os
import pickle
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core import CheckpointingException
from ..exchange import all_gather_objects, collective_device, describe_error, raise_gathered_errors

logger = logging.getLogger(__name__)


@dataclass
class AsyncRequest:
    """``async_fn(*async_fn_args, **async_fn_kwargs)`` to run in the background, then ``finalize_fns`` (in order,
    on every rank) once all ranks have run theirs. Freeze it before scheduling so nothing is added late."""

    async_fn: Optional[Callable]
    async_fn_args: Tuple
    finalize_fns: List[Callable]
    async_fn_kwargs: Dict[str, Any] = field(default_factory=dict)
    is_frozen: bool = False
    async_fn_result: Any = None

    def add_finalize_fn(self, fn: Callable) -> None:
        """Append a function to run after the existing finalize functions."""
        if self.is_frozen:
            raise CheckpointingException("cannot add a finalize function to a frozen (already scheduled) AsyncRequest")
        self.finalize_fns.append(fn)

    def run_async_fn(self) -> Any:
        return None if self.async_fn is None else self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)

    def execute_sync(self) -> None:
        """Run the whole request in the calling thread: the synchronous save."""
        self.async_fn_result = self.run_async_fn()
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        self.is_frozen = True
        return self


class _BackgroundCall:
    """One request's async_fn running in a forked process or a thread; keeps its result or its error."""

    def __init__(self, call_idx: int, request: AsyncRequest, worker: str):
        self.call_idx = call_idx
        self.request = request
        self.error: Optional[str] = None
        if worker == "process":
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _run_in_child(request, write_fd)
            os.close(write_fd)
            target, args = self._collect_from_child, (pid, read_fd)
        else:
            target, args = self._run_here, ()
        # The thread only waits on the child (reading a pipe releases the GIL) or runs the write itself.
        self.thread = threading.Thread(target=target, args=args, name=f"async-checkpoint-{call_idx}", daemon=True)
        self.thread.start()

    def _run_here(self) -> None:
        try:
            self.request.async_fn_result = self.request.run_async_fn()
        except BaseException as error:  # reported to every rank at finalisation
            self.error = describe_error(error)

    def _collect_from_child(self, pid: int, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            payload = pipe.read()
        _, status = os.waitpid(pid, 0)
        if not payload:
            self.error = f"the background writer process {pid} died (wait status {status}) before reporting"
            return
        kind, value = pickle.loads(payload)
        if kind == "ok":
            self.request.async_fn_result = value
        else:
            self.error = value

    def is_done(self) -> bool:
        return not self.thread.is_alive()


def _run_in_child(request: AsyncRequest, write_fd: int) -> None:
    """The forked child: run the write, send ("ok", result) or ("error", message) to the parent, exit at once
    (no atexit handlers, no flushing of the parent's buffers)."""
    try:
        outcome = ("ok", request.run_async_fn())
        payload = pickle.dumps(outcome)
    except BaseException as error:
        payload = pickle.dumps(("error", describe_error(error)))
    try:
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(payload)
    finally:
        os._exit(0)


class AsyncCallsQueue:
    """Requests scheduled for background execution, finalised in scheduling order. ``worker`` is ``"process"``
    (a forked child per request; the default where ``fork`` exists) or ``"thread"``."""

    def __init__(self, worker: Optional[str] = None):
        if worker is None:
            worker = "process" if hasattr(os, "fork") else "thread"
        if worker not in ("process", "thread"):
            raise ValueError(f"worker={worker!r} must be 'process' or 'thread'")
        self.worker = worker
        self._calls: Deque[_BackgroundCall] = deque()
        self._next_call_idx = 0

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request``'s write in the background; returns its call index."""
        call = _BackgroundCall(self._next_call_idx, async_request.freeze(), self.worker)
        self._next_call_idx += 1
        self._calls.append(call)
        return call.call_idx

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalise, in order, the requests whose background work is done on every rank; return their indices.

        With ``blocking`` wait for all of them. With ``no_dist`` decide from this rank alone (single-process use).
        Raises :class:`CheckpointingException` on every rank when a background write failed on any rank; that
        request's finalize functions are then not run, so the checkpoint is never marked complete.
        """
        finalized = []
        while self._calls:
            call = self._calls[0]
            if blocking:
                call.thread.join()
            flags = torch.tensor(
                [int(not call.is_done()), int(call.error is not None)], dtype=torch.int64, device=collective_device()
            )
            if not no_dist and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[0].item():
                break
            self._calls.popleft()
            if flags[1].item():
                errors = [call.error] if no_dist else all_gather_objects(call.error)
                raise_gathered_errors(errors, f"asynchronous checkpoint write (call {call.call_idx})")
            for fn in call.request.finalize_fns:
                fn()
            finalized.append(call.call_idx)
        return finalized

    def close(self) -> None:
        """Wait for and finalise every pending request (call on all ranks before exiting)."""
        self.maybe_finalize_async_calls(blocking=True)
