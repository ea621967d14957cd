"""Asynchronous checkpoint saving: write in the background, finalise only when every rank has finished.

An :class:`AsyncRequest` is a function that writes already-staged data (``async_fn``) plus the functions that
finalise the checkpoint once the writes of *all* ranks are done (``finalize_fns``: the DCP ``.metadata``, then
``metadata.json``, then e.g. the training loop's "latest" tracker). :class:`AsyncCallsQueue` runs each request's
``async_fn`` in a background **thread** and, from the training loop, :meth:`AsyncCallsQueue.maybe_finalize_async_calls`
agrees with the other ranks (one small all-reduce per pending request) on which requests have finished everywhere
and runs their finalize functions on every rank.

Why a thread and not a process: the staged tensors already live in host memory, so a thread needs no copy into
another process and no fork of a process that holds communicator threads; the write is file I/O and tensor
serialisation, which release the GIL for the bulk of the bytes. The cost is that the Python parts of the write
(pickling small objects) compete with the training loop for the GIL; ``benchmarks/bench_checkpoint.py`` measures
the resulting stall.

Every rank must call ``maybe_finalize_async_calls`` the same number of times (e.g. once per training iteration),
because each call takes part in a collective.
"""

import logging
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

    def add_finalize_fn(self, fn: Callable) -> None:
        """Append a function to run after the existing finalize functions."""
        if self.is_frozen:
            raise CheckpointingException("cannot add a finalize function to a frozen (already scheduled) AsyncRequest")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Run the whole request in the calling thread: the synchronous save."""
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        self.is_frozen = True
        return self


class _BackgroundCall:
    """One request's async_fn running in a thread; remembers the exception it raised, if any."""

    def __init__(self, call_idx: int, request: AsyncRequest):
        self.call_idx = call_idx
        self.request = request
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name=f"async-checkpoint-{call_idx}", daemon=False)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.request.async_fn is not None:
                self.request.async_fn(*self.request.async_fn_args, **self.request.async_fn_kwargs)
        except BaseException as error:  # reported to every rank at finalisation
            self.error = error

    def is_done(self) -> bool:
        return not self.thread.is_alive()


class AsyncCallsQueue:
    """Requests scheduled for background execution, finalised in scheduling order."""

    def __init__(self):
        self._calls: Deque[_BackgroundCall] = deque()
        self._next_call_idx = 0

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request``'s write in the background; returns its call index."""
        call = _BackgroundCall(self._next_call_idx, async_request.freeze())
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
            if not no_dist and dist.is_initialized():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[0].item():
                break
            self._calls.popleft()
            if flags[1].item():
                message = None if call.error is None else describe_error(call.error)
                errors = [message] if no_dist else all_gather_objects(message)
                raise_gathered_errors(errors, f"asynchronous checkpoint write (call {call.call_idx})")
            for fn in call.request.finalize_fns:
                fn()
            finalized.append(call.call_idx)
        return finalized

    def close(self) -> None:
        """Wait for and finalise every pending request (call on all ranks before exiting)."""
        self.maybe_finalize_async_calls(blocking=True)
