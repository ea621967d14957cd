"""The engine loop behind the server: requests from HTTP handlers in, tokens back out, every rank in lockstep.

Rank 0 runs the web server (asyncio, main thread) and this loop (one thread that owns the engine). Each turn of the
loop takes the requests submitted since the last turn, broadcasts them to the other model-parallel ranks, adds them
to the :class:`DynamicInferenceEngine` and runs one engine step, which batches every running request (continuous
batching: requests join and leave between steps). After the step it reports each request's new tokens to the
handler waiting on it. The other ranks run :meth:`ServingLoop.follow`: receive the turn's requests, add them, step,
so every rank issues the same collectives in the same order. A request whose client went away is cancelled the
same way: :meth:`ServingLoop.cancel` queues it, the next turn names it, and every rank drops it from its engine
between steps, so its KV-cache blocks and batch slot are free for the next request.

The broadcast is JSON bytes in a uint8 tensor over a gloo group (request text from the network is never pickled).
While idle, rank 0 still broadcasts an empty turn every ``heartbeat_s`` seconds, so the waiting ranks are never
left in one broadcast long enough to hit the process group's timeout.
"""

import asyncio
import dataclasses
import json
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.utils import get_current_device, set_device_for_rank

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """What one engine step produced for a request: its new tokens (and their log-probs when asked), whether it
    finished, and an error message if the engine refused or failed it."""

    tokens: List[int] = field(default_factory=list)
    log_probs: List[float] = field(default_factory=list)
    top_logprobs: List[Dict[str, float]] = field(default_factory=list)
    prompt_log_probs: Optional[List[float]] = None
    finished: bool = False
    error: Optional[str] = None
    error_is_client_error: bool = False


class RequestHandle:
    """The asyncio side of one submitted request: iterate it to get its :class:`Progress` reports."""

    def __init__(self, request_id: int, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def _push(self, progress: Progress) -> None:  # called from the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, progress)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Progress:
        progress = await self._queue.get()
        if progress is None:
            raise StopAsyncIteration
        if progress.finished or progress.error is not None:
            self._queue.put_nowait(None)  # the next call ends the iteration
        return progress


def _sampling_params_to_json(params: SamplingParams) -> dict:
    return dataclasses.asdict(params)


@dataclass
class _Submission:
    request_id: int
    tokens: List[int]
    params: SamplingParams
    handle: RequestHandle


@dataclass
class _Cancellation:
    request_id: int


class ServingLoop:
    """Owns the engine: :meth:`submit` (rank 0, from the event loop), :meth:`run` (rank 0's engine thread, started
    by :meth:`start`), :meth:`follow` (every other rank), :meth:`shutdown` (rank 0: stops every rank)."""

    def __init__(self, engine, group: Optional[dist.ProcessGroup] = None, src_rank: int = 0, heartbeat_s: float = 1.0):
        self.engine = engine
        self.group = group
        self.src_rank = src_rank
        self.heartbeat_s = heartbeat_s
        self._distributed = group is not None and dist.get_world_size(group) > 1
        # What handlers hand the engine thread: submissions, cancellations, and None (shutdown's wake-up call).
        self._submitted: "queue.Queue[Union[_Submission, _Cancellation, None]]" = queue.Queue()
        self._handles: Dict[int, RequestHandle] = {}
        self._reported: Dict[int, int] = {}
        self._next_id = 0
        self._id_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.fatal_error: Optional[BaseException] = None
        self.cancelled = 0  # requests cancelled so far (clients that went away), for /health

    # ---------------------------------------------------------------- rank 0, event-loop side

    def submit(self, prompt_tokens: List[int], sampling_params: SamplingParams) -> RequestHandle:
        """Queue one generation; the returned handle yields its progress (call from inside the event loop)."""
        if self.fatal_error is not None or self._stopping.is_set():
            raise RuntimeError(f"the inference engine is not running ({self.fatal_error or 'shutting down'})")
        with self._id_lock:
            request_id = self._next_id
            self._next_id += 1
        handle = RequestHandle(request_id, asyncio.get_running_loop())
        self._submitted.put(_Submission(request_id, list(prompt_tokens), sampling_params, handle))
        return handle

    def cancel(self, request_id: int) -> None:
        """Drop a submitted request (its client went away): the engine thread removes it from the engine on every
        rank before its next step. A request that already finished is left alone. Thread-safe."""
        self._submitted.put(_Cancellation(request_id))

    @property
    def requests_in_engine(self) -> int:
        """Requests the engine holds for clients (generating or waiting for room), for /health."""
        return len(self._handles)

    def start(self) -> None:
        device = get_current_device()  # the CUDA device is per thread: the engine thread takes this rank's
        self._thread = threading.Thread(target=self._run_guarded, args=(device,), name="inference-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the loop (the other ranks' :meth:`follow` returns too) and wait for the engine thread."""
        self._stopping.set()
        self._submitted.put(None)  # wakes the engine thread if it is waiting for work
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------- rank 0, engine thread

    def _run_guarded(self, device: torch.device) -> None:
        try:
            if device.type == "cuda":
                set_device_for_rank(device.index)
            with torch.inference_mode():  # grad mode is per thread: this thread runs the model
                self.run()
        except BaseException as error:  # the engine broke: every waiting request hears about it, then we stop
            logger.exception("inference engine loop failed")
            self.fatal_error = error
            for handle in list(self._handles.values()):
                handle._push(Progress(error=f"the inference engine failed: {error}"))
            self._handles.clear()

    def run(self) -> None:
        """Rank 0's loop until :meth:`shutdown`: gather new requests and cancellations, broadcast, apply, step,
        report."""
        while True:
            new, cancels = self._take_submitted(block=not self.engine.has_unfinished_requests())
            stop = self._stopping.is_set()
            known = set(self._handles) | {item.request_id for item in new}
            cancels = [request_id for request_id in cancels if request_id in known]  # finished ones: nothing to do
            turn = {
                "add": [[s.request_id, s.tokens, _sampling_params_to_json(s.params)] for s in new],
                "cancel": cancels,
                "stop": stop,
            }
            if self._distributed:
                self._broadcast(turn)
            if stop:
                for item in new:
                    item.handle._push(Progress(error="the server is shutting down"))
                return
            for item in new:
                self._handles[item.request_id] = item.handle
                self._reported[item.request_id] = 0
                error = self._add(item.request_id, item.tokens, item.params)
                if error is not None:
                    self._forget(item.request_id)._push(Progress(error=error, error_is_client_error=True))
            for request_id in cancels:
                if self.engine.cancel_request(request_id):
                    self.cancelled += 1
                if request_id in self._handles:
                    self._forget(request_id)._push(Progress(error="the request was cancelled"))
            if self.engine.has_unfinished_requests():
                finished = self._step()
                self._report()
                self._release(finished)

    def _take_submitted(self, block: bool) -> Tuple[List[_Submission], List[int]]:
        """The requests submitted and the request ids cancelled since the last turn (waiting up to
        ``heartbeat_s`` for something when ``block``)."""
        items = []
        if block:
            try:
                items.append(self._submitted.get(timeout=self.heartbeat_s))
            except queue.Empty:
                return [], []
        while True:
            try:
                items.append(self._submitted.get_nowait())
            except queue.Empty:
                break
        new = [item for item in items if isinstance(item, _Submission)]
        return new, [item.request_id for item in items if isinstance(item, _Cancellation)]

    def _report(self) -> None:
        for request_id in list(self._handles):
            request = self.engine.get_request(request_id)
            sent = self._reported[request_id]
            params = request.sampling_params
            new_tokens = [int(t) for t in request.generated_tokens[sent:]]
            finished = request.finished
            if not new_tokens and not finished:
                continue
            progress = Progress(tokens=new_tokens, finished=finished)
            if params.return_log_probs:
                progress.log_probs = [float(x) for x in (request.generated_log_probs or [])[sent:]]
                if params.top_n_logprobs:
                    progress.top_logprobs = list((request.generated_top_n_logprobs or [])[sent:])
                if sent == 0 and not params.skip_prompt_log_probs:
                    progress.prompt_log_probs = [float(x) for x in (request.prompt_log_probs or [])]
            if finished and request.status.name == "FAILED":
                progress.error = _failure_message(request)
            self._reported[request_id] = sent + len(new_tokens)
            self._handles[request_id]._push(progress)
            if finished:
                self._forget(request_id)

    def _forget(self, request_id: int) -> RequestHandle:
        self._reported.pop(request_id, None)
        return self._handles.pop(request_id)

    # ---------------------------------------------------------------- every rank

    def _add(self, request_id: int, tokens: List[int], params: SamplingParams) -> Optional[str]:
        """Add one request to the engine; the engine's refusal (a ValueError: it cannot fit, ...) is the request's
        error, identical on every rank, so the ranks stay in step."""
        try:
            self.engine.add_request(request_id, tokens, params)
        except ValueError as error:
            return str(error)
        return None

    def _step(self) -> list:
        """One engine step; the requests it finished."""
        _, finished, _ = self.engine.step_modern()
        return finished

    def _release(self, finished) -> None:
        """Drop finished requests from the engine (it keeps them until asked), on every rank alike."""
        for request in finished:
            self.engine.pop_request(request.request_id)

    def follow(self) -> None:
        """Every rank but the source: mirror rank 0's turns until it says stop."""
        with torch.inference_mode():
            self._follow()

    def _follow(self) -> None:
        while True:
            turn = self._broadcast(None)
            if turn["stop"]:
                return
            for request_id, tokens, params in turn["add"]:
                self._add(request_id, tokens, SamplingParams(**params))
            for request_id in turn["cancel"]:
                self.engine.cancel_request(request_id)
            if self.engine.has_unfinished_requests():
                self._release(self._step())

    def _broadcast(self, turn: Optional[dict]) -> dict:
        """Rank 0's ``turn`` on every rank: its length, then its JSON bytes."""
        if turn is not None:
            payload = torch.frombuffer(bytearray(json.dumps(turn).encode("utf-8")), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=self.src_rank, group=self.group)
        if turn is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=self.src_rank, group=self.group)
        return turn if turn is not None else json.loads(payload.numpy().tobytes().decode("utf-8"))


def _failure_message(request) -> str:
    for event in reversed(getattr(request, "events", None) or []):
        if event.type.name == "FAIL" and event.payload:
            return str(event.payload)
    return "the inference engine could not complete this request"
