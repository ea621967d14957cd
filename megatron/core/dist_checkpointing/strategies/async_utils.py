"""Asynchronous checkpoint saving: write in the background, finalise only when every rank has finished.

An :class:`AsyncRequest` is a function that writes already-staged data (``async_fn``) plus the functions that
finalise the checkpoint once the writes of *all* ranks are done (``finalize_fns``: the DCP ``.metadata``, then
``metadata.json``, then e.g. the training loop's "latest" tracker); what ``async_fn`` returns is kept in
``async_fn_result`` for them. :class:`AsyncCallsQueue` runs each ``async_fn`` in the background (a
:class:`TemporalAsyncCaller` per request) and, from the training loop,
:meth:`AsyncCallsQueue.maybe_finalize_async_calls` agrees with the other ranks (one small all-reduce per pending
request) on which requests have finished everywhere and runs their finalize functions on every rank.

The background worker is a forked **process** by default (as in Megatron-LM), or a **thread**. Why a process: the
write is mostly ``torch.save`` serialisation (zip records, CRC32, copies into the file object), parts of which hold
the GIL; a writer thread then delays every return of the training thread into Python, e.g. after each collective
(measured on CPU: a 2-int all-reduce poll takes ~2 ms with a writer thread running, ~0.2 ms with a writer process).
The forked child sees the staged tensors without a copy (copy-on-write), writes its files, sends its result back
through a pipe and exits; it takes part in no collective. A thread worker (``queue.worker = "thread"``) remains for
platforms without ``fork``; ``benchmarks/bench_checkpoint.py`` measures the training stall with both.

Every rank must call ``maybe_finalize_async_calls`` the same number of times (e.g. once per training iteration),
because each call takes part in a collective.
"""

import logging
import os
import pickle
import signal
import threading
from abc import ABC, abstractmethod
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


class AsyncCaller(ABC):
    """Runs the ``async_fn`` of one request at a time in the background and tells when every rank has finished."""

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Start ``async_req.async_fn`` in the background."""

    @abstractmethod
    def is_current_async_call_done(self, blocking: bool, no_dist: bool) -> bool:
        """Whether the current call is done on every rank (with ``no_dist``: on this rank); a collective unless
        ``no_dist``. With ``blocking`` wait for this rank's call first."""

    @abstractmethod
    def close(self, abort=False):
        """Release the background worker; with ``abort`` stop a running call instead of waiting for it."""

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """Collective: True when no rank reports a call still running (``is_alive`` 0 everywhere)."""
        flag = torch.tensor([is_alive], dtype=torch.int64, device=collective_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0


class TemporalAsyncCaller(AsyncCaller):
    """A new background worker per call: a forked process (the default where ``fork`` exists) or a thread
    (``worker = "thread"``). The result of ``async_fn`` lands in the request's ``async_fn_result``; an exception
    (or a process that dies) is kept in :attr:`error` as a message."""

    def __init__(self):
        self.worker = default_worker()
        self.request: Optional[AsyncRequest] = None
        self.error: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._pid: Optional[int] = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        self.request, self.error = async_req, None
        if self.worker == "process":
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _run_in_child(async_req, write_fd)
            os.close(write_fd)
            self._pid = pid
            target, args = self._collect_from_child, (pid, read_fd)
        else:
            target, args = self._run_here, ()
        # The thread only waits on the child (reading a pipe releases the GIL) or runs the write itself.
        self._thread = threading.Thread(target=target, args=args, name="async-checkpoint", daemon=True)
        self._thread.start()

    def _run_here(self) -> None:
        try:
            self.request.async_fn_result = self.request.run_async_fn()
        except BaseException as error:  # reported to every rank at finalisation
            self.error = describe_error(error)

    def _collect_from_child(self, pid: int, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            payload = pipe.read()
        _, status = os.waitpid(pid, 0)
        self._pid = None
        if not payload:
            self.error = f"the background writer process {pid} died (wait status {status}) before reporting"
            return
        kind, value = pickle.loads(payload)  # this process's own child's result, never a file's bytes
        if kind == "ok":
            self.request.async_fn_result = value
        else:
            self.error = value

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if blocking and self._thread is not None:
            self._thread.join()
        alive = int(self._thread is not None and self._thread.is_alive())
        return not alive if no_dist else self.sync_all_async_calls(alive)

    def close(self, abort=False):
        if abort and self._pid is not None:
            os.kill(self._pid, signal.SIGKILL)  # the collecting thread then reaps it
        if self._thread is not None and (not abort or self.worker == "process"):
            self._thread.join()


def default_worker() -> str:
    """The background worker where ``fork`` exists: a forked process (see the module docstring); else a thread."""
    return "process" if hasattr(os, "fork") else "thread"


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
    """Requests scheduled for background execution (one :class:`TemporalAsyncCaller` each), finalised in
    scheduling order. ``persistent=True`` (Megatron's long-lived writer process) is not supported yet. The
    background worker is :func:`default_worker`'s; set :attr:`worker` to ``"thread"`` or ``"process"`` to choose."""

    def __init__(self, persistent: bool = False):
        if persistent:
            raise ValueError("AsyncCallsQueue: not supported yet: a persistent background writer (persistent=True)")
        self.persistent = persistent
        self.worker = default_worker()
        self._calls: Deque[Tuple[int, TemporalAsyncCaller]] = deque()
        self._next_call_idx = 0

    @classmethod
    def warmup_persistent_caller(
        cls, rank: int, mp_mode: str = "spawn", cpu_priority: int = 10, io_priority: Optional[int] = None
    ):
        """Megatron starts its persistent writer process ahead of the first save; there is none here."""
        raise ValueError(
            "AsyncCallsQueue: not supported yet: a persistent background writer (warmup_persistent_caller)"
        )

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request``'s write in the background; returns its call index."""
        if self.worker not in ("process", "thread"):
            raise ValueError(f"worker={self.worker!r} must be 'process' or 'thread'")
        caller = TemporalAsyncCaller()
        caller.worker = self.worker
        caller.schedule_async_call(async_request.freeze())
        call_idx = self._next_call_idx
        self._next_call_idx += 1
        self._calls.append((call_idx, caller))
        return call_idx

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
            call_idx, caller = self._calls[0]
            if not caller.is_current_async_call_done(blocking, no_dist):
                break
            self._calls.popleft()
            errors = [caller.error] if no_dist else all_gather_objects(caller.error)
            raise_gathered_errors(errors, f"asynchronous checkpoint write (call {call_idx})")
            for fn in caller.request.finalize_fns:
                fn()
            finalized.append(call_idx)
        return finalized

    def close(self, abort=False):
        """Wait for and finalise every pending request (call on all ranks before exiting); with ``abort`` stop the
        running writes and finalise nothing, so no pending checkpoint is marked complete."""
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
            return
        while self._calls:
            self._calls.popleft()[1].close(abort=True)
