"""The dynamic engine: continuous batching over a paged KV cache.

Requests join and leave the running batch between steps. Each step runs, in one forward, one token for every
request that is decoding plus prompt chunks of requests in prefill (filling the context's ``max_tokens`` budget),
then samples a token for each request whose prompt is complete.

How a server drives it::

    engine = DynamicInferenceEngine(controller, context)
    future = engine.add_request(request_id, "prompt text" or token ids, SamplingParams(...))
    while engine.has_unfinished_requests():
        active, finished, seconds = engine.step_modern()    # new tokens: request.generated_tokens grew
    request = engine.get_request(request_id)                # request.finished, .generated_text, ...

``add_request`` validates before anything runs: a bad sampling parameter, or a request that can never fit the
context (prompt plus ``num_tokens_to_generate`` beyond ``max_sequence_length``, or more blocks than the cache has),
raises a ValueError (a ContextOverflowError for the latter) and leaves the engine unchanged. The engine keeps every
request it was given (``get_request`` works after it finished) until :meth:`pop_request` / :meth:`reset`.
Streaming: ``request.events`` gets a GENERATED_TOKEN event per token; on an asyncio loop that runs
``await engine.run_engine()`` (single rank), ``engine.get_stream_generator(request_id)`` yields the request after
each new token, and the future resolves with the finished request.

Model parallelism: the engine's bookkeeping is replicated, so every rank of the TP x PP group must call
``add_request`` with the same arguments and ``step_modern`` the same number of times (a server broadcasts each
turn's new requests from rank 0 first). The sampled tokens themselves are broadcast from the last pipeline stage
inside the step. ``generate`` does the request broadcast itself: every rank calls it, the first rank's prompts
are the ones used.
"""

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass
from enum import Enum, auto
from typing import AsyncGenerator, Deque, Dict, List, Optional, Tuple, Union

import torch

from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines.abstract_engine import AbstractEngine, RequestStreams
from megatron.core.inference.engines.lockstep import Lockstep
from megatron.core.inference.inference_request import (
    DynamicInferenceEventType,
    DynamicInferenceRequest,
    DynamicInferenceRequestRecord,
    Status,
)
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    DynamicStep,
    TextGenerationController,
)
from megatron.core.utils import get_attr_wrapped_model


class EngineState(Enum):
    RUNNING = auto()
    PAUSING = auto()
    PAUSED = auto()
    UNPAUSING = auto()
    SUSPENDING = auto()
    SUSPENDED = auto()
    RESUMING = auto()
    RESUMED = auto()
    STOPPING = auto()
    STOPPED = auto()


class EngineSuspendedError(RuntimeError):
    """A request was added while the engine is suspended."""


@dataclass
class RequestEntry:
    record: DynamicInferenceRequestRecord
    future: asyncio.Future


def format_mem_bytes(mem_bytes) -> str:
    """``1536`` -> ``'1.5 kb'``: bytes in the largest unit that keeps the number >= 1."""
    for power, suffix in ((4, "tb"), (3, "gb"), (2, "mb"), (1, "kb")):
        if mem_bytes >= 1024**power:
            return f"{mem_bytes / 1024**power:.1f} {suffix}"
    return f"{mem_bytes} bytes"


class DynamicInferenceEngine(AbstractEngine):
    """Continuous batching with ``controller`` (its wrapper's model) over the paged KV cache ``context``."""

    def __init__(self, controller: TextGenerationController, context: DynamicInferenceContext):
        if not isinstance(context, DynamicInferenceContext):
            raise ValueError(f"DynamicInferenceEngine needs a DynamicInferenceContext, got {type(context).__name__}")
        model = controller.inference_wrapped_model.model
        model_max = get_attr_wrapped_model(model, "max_sequence_length")
        if get_attr_wrapped_model(model, "position_embedding_type") == "learned_absolute" and (
            context.max_sequence_length > model_max
        ):
            raise ValueError(
                f"the context's max_sequence_length={context.max_sequence_length} exceeds the model's learned "
                f"position table ({model_max} positions); lower --inference-max-seq-length"
            )
        self.controller = controller
        self.context = context
        controller.inference_wrapped_model.inference_context = context
        controller.max_sequence_length = context.max_sequence_length
        self.lockstep = Lockstep()
        self.requests: Dict[object, RequestEntry] = {}
        self.waiting: Deque[object] = deque()
        self.active: List[object] = []
        self._streams = RequestStreams()
        self._own_loop: Optional[asyncio.AbstractEventLoop] = None
        self._next_request_id = 0
        self.state = EngineState.RUNNING
        self.step_count = 0

    # ---- requests ----

    def _loop_for_futures(self) -> asyncio.AbstractEventLoop:
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            if self._own_loop is None:
                self._own_loop = asyncio.new_event_loop()
            return self._own_loop

    def _new_request(self, request_id, prompt, sampling_params: SamplingParams) -> DynamicInferenceRequest:
        """Tokenize and validate; raises before anything is shared with other ranks."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        sampling_params.validate()
        if isinstance(prompt, str):
            text = prompt
            tokens = self.controller.tokenize_prompt(self.controller.tokenizer, prompt, sampling_params.add_BOS)
        elif isinstance(prompt, torch.Tensor):
            text, tokens = None, [int(t) for t in prompt.reshape(-1).tolist()]
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, tokens = None, list(prompt)
        else:
            raise ValueError(
                f"request {request_id}: the prompt must be a string or token ids, got {type(prompt).__name__}"
            )
        if not tokens:
            raise ValueError(f"request {request_id}: the prompt has no tokens")
        vocab = self.controller.vocab_size
        if vocab is not None and not all(0 <= t < vocab for t in tokens):
            raise ValueError(f"request {request_id}: prompt token ids must be in [0, {vocab})")
        max_new = sampling_params.num_tokens_to_generate
        if max_new is None:
            max_new = sampling_params.max_new_tokens(len(tokens), self.context.max_sequence_length)
        if sampling_params.num_tokens_total is not None:
            max_new = min(max_new, sampling_params.num_tokens_total - len(tokens))
        self.context.check_request(request_id, len(tokens) + max(max_new, 0))
        if max_new < 0:
            raise ValueError(
                f"request {request_id}: num_tokens_total is smaller than the prompt ({len(tokens)} tokens)"
            )
        request = DynamicInferenceRequest(
            request_id=request_id,
            prompt=text,
            prompt_tokens=tokens,
            sampling_params=sampling_params,
            block_size_tokens=self.context.block_size_tokens,
        )
        request.max_new_tokens = max_new
        if sampling_params.return_log_probs and not sampling_params.skip_prompt_log_probs:
            request.prompt_log_probs = []
        return request

    def add_request(
        self,
        request_id: int,
        prompt: Union[str, List[int], torch.Tensor],
        sampling_params: Optional[SamplingParams] = None,
    ) -> "asyncio.Future[DynamicInferenceRequest]":
        """Queue a request; returns a future resolved with the finished request (on the running event loop
        when called from one). The request joins the batch at the next step with room for it."""
        if self.state in (EngineState.SUSPENDED, EngineState.SUSPENDING):
            raise EngineSuspendedError("the engine is suspended; resume() it before adding requests")
        return self._enqueue(self._new_request(request_id, prompt, sampling_params))

    def _enqueue(self, request: DynamicInferenceRequest) -> asyncio.Future:
        future = self._loop_for_futures().create_future()
        self.requests[request.request_id] = RequestEntry(DynamicInferenceRequestRecord.from_request(request), future)
        request.add_event(DynamicInferenceEventType.ADD_ENGINE)
        self.waiting.append(request.request_id)
        return future

    def get_request(self, request_id: int) -> DynamicInferenceRequest:
        return self.requests[request_id].record.merge()

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.active)

    def get_new_request_id(self) -> int:
        while self._next_request_id in self.requests:
            self._next_request_id += 1
        self._next_request_id += 1
        return self._next_request_id - 1

    def get_stream_generator(self, request_id) -> AsyncGenerator[DynamicInferenceRequest, None]:
        """An async generator that yields a snapshot of the request after each of its new tokens and ends when
        it finishes. Call it (on the event loop that will consume it) right after add_request."""
        if request_id not in self.requests:
            raise ValueError(f"no request with id {request_id!r}")
        return self._streams.open(request_id)

    def _notify(self, request: DynamicInferenceRequest, finished: bool) -> None:
        self._streams.push(request, finished)
        if finished:
            future = self.requests[request.request_id].future
            if future.get_loop().is_running():
                future.get_loop().call_soon_threadsafe(_resolve, future, request)
            else:
                _resolve(future, request)

    # ---- scheduling ----

    def schedule_waiting_requests(self) -> None:
        """Move waiting requests into the batch, oldest first, while the context has room (a request that
        does not fit now waits; later ones do not overtake it, so no request starves)."""
        while self.waiting:
            request = self.get_request(self.waiting[0])
            total = len(request.prompt_tokens) + request.max_new_tokens
            if not self.context.has_room_for(total):
                return
            self.context.add_request(request.request_id, total)
            self.waiting.popleft()
            self.active.append(request.request_id)
            request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
            request.add_event(DynamicInferenceEventType.ADD_CONTEXT)

    def schedule_requests(self) -> int:
        """Admit what fits; returns the number of active requests."""
        self.schedule_waiting_requests()
        return len(self.active)

    def _plan_step(self) -> Optional[Tuple[DynamicStep, List[Tuple[object, List[int]]]]]:
        """Decode tokens first (one per decoding request), then prompt chunks, within ``max_tokens``."""
        budget = self.context.max_tokens
        requests, chunks, samples = [], [], []
        for request_id in self.active:
            request = self.get_request(request_id)
            if not request.remaining_prompt_tokens:
                requests.append(request)
                chunks.append((request_id, [request.generated_tokens[-1]]))
                samples.append(True)
                budget -= 1
        for request_id in self.active:
            request = self.get_request(request_id)
            if request.remaining_prompt_tokens and budget > 0:
                chunk = request.remaining_prompt_tokens[:budget]
                budget -= len(chunk)
                requests.append(request)
                chunks.append((request_id, chunk))
                samples.append(len(chunk) == len(request.remaining_prompt_tokens))
        if not chunks:
            return None
        targets = None
        if any(r.prompt_log_probs is not None for r in requests):
            targets = []
            for request, (request_id, chunk) in zip(requests, chunks):
                start = self.context.request_length(request_id)
                prompt = request.prompt_tokens
                for p in range(start, start + len(chunk)):
                    in_prompt = request.prompt_log_probs is not None and p + 1 < len(prompt)
                    targets.append(prompt[p + 1] if in_prompt else -1)
        plan = DynamicStep(requests, [len(c) for _, c in chunks], samples, targets)
        return plan, chunks

    # ---- stepping ----

    def step_modern(self) -> Tuple[List[DynamicInferenceRequest], List[DynamicInferenceRequest], float]:
        """One step: returns ``(active requests, requests finished by this step, seconds)``."""
        return self._step()

    def step(
        self, sampling_params: SamplingParams
    ) -> Tuple[List[DynamicInferenceRequest], List[DynamicInferenceRequest], float]:
        """Megatron's older entry point: requests carry their own sampling parameters, so ``sampling_params``
        is not consulted; same as :meth:`step_modern`."""
        return self.step_modern()

    def step_legacy(
        self, sampling_params: SamplingParams
    ) -> Tuple[List[DynamicInferenceRequest], List[DynamicInferenceRequest], float]:
        return self.step_modern()

    def _step(self) -> Tuple[List[DynamicInferenceRequest], List[DynamicInferenceRequest], float]:
        start = time.perf_counter()
        self.schedule_waiting_requests()
        planned = self._plan_step()
        if planned is None:
            return [], [], 0.0
        plan, chunks = planned
        self.context.prepare_step(chunks)
        self.controller.dynamic_step = plan
        result = self.controller.generate_output_tokens_dynamic_batch()["step"]
        finished = self._bookkeep(plan, result)
        self.step_count += 1
        active = [self.get_request(r) for r in self.active]
        return active, finished, time.perf_counter() - start

    def _bookkeep(self, plan: DynamicStep, result) -> List[DynamicInferenceRequest]:
        now = time.time()
        finished = []
        offset = 0
        for i, (request, n) in enumerate(zip(plan.requests, plan.chunk_lengths)):
            if result.token_log_probs is not None and request.prompt_log_probs is not None:
                pairs = zip(
                    result.token_log_probs[offset : offset + n], plan.prompt_log_prob_targets[offset : offset + n]
                )
                request.prompt_log_probs.extend(lp for lp, target in pairs if target >= 0)
            offset += n
            if request.remaining_prompt_tokens:
                request.remaining_prompt_tokens = request.remaining_prompt_tokens[n:]
                request.finished_chunk_token_count += n
            if not plan.samples[i]:
                continue
            token = result.tokens[i]
            top = result.top_n[i] if result.top_n is not None else None
            done = self.controller.append_token(request, token, result.log_probs[i], top, request.max_new_tokens)
            if len(request.generated_tokens) == 1:
                request.ttft = now - request.arrival_time
                request.status = Status.ACTIVE_AND_GENERATING_TOKENS
            else:
                request.tpot.append(now - request.events[-1].timestamp)
            request.add_event(DynamicInferenceEventType.GENERATED_TOKEN, token)
            if done:
                self._finish(request, now)
                finished.append(request)
            else:
                self._notify(request, finished=False)
        return finished

    def _finish(self, request: DynamicInferenceRequest, now: float) -> None:
        self.controller.finish_request(request)
        request.latency = now - request.arrival_time
        request.add_event(DynamicInferenceEventType.FINISH)
        self.context.release_request(request.request_id)
        self.active.remove(request.request_id)
        self._notify(request, finished=True)

    def generate(
        self, prompts: List[str], sampling_params: Optional[SamplingParams] = SamplingParams()
    ) -> List[DynamicInferenceRequest]:
        """Generate for every prompt (strings or token-id lists) and return the finished requests in order.
        Every rank of the model-parallel group calls it; the first rank's prompts and sampling parameters are
        broadcast and used everywhere."""
        shared = self.lockstep.share(
            {"prompts": list(prompts), "sampling_params": asdict(sampling_params or SamplingParams())}
            if self.lockstep.is_leader
            else None
        )
        ids = []
        for prompt in shared["prompts"]:
            request_id = self.get_new_request_id()
            self.add_request(request_id, prompt, SamplingParams(**shared["sampling_params"]))
            ids.append(request_id)
        while self.has_unfinished_requests():
            self.step_modern()
        return [self.pop_request(request_id) for request_id in ids]

    def cancel_request(self, request_id) -> bool:
        """Ours (not in Megatron-Core): stop an unfinished request between steps and drop it from the engine, so
        its KV-cache blocks and its batch slot go to others at once (a server calls it when the client went away).
        The request ends FAILED with a FAIL event "cancelled". Returns False when there is nothing to cancel (no
        such request, or it already finished). Model parallelism: every rank cancels the same ids at the same
        point between steps, as with :meth:`add_request`."""
        entry = self.requests.get(request_id)
        if entry is None or entry.record.merge().finished:
            return False
        request = entry.record.merge()
        if request_id in self.active:
            self.context.release_request(request_id)
            self.active.remove(request_id)
        else:
            self.waiting.remove(request_id)
        request.status = Status.FAILED
        request.add_event(DynamicInferenceEventType.FAIL, "cancelled")
        self._notify(request, finished=True)
        del self.requests[request_id]
        return True

    def pop_request(self, request_id) -> DynamicInferenceRequest:
        """Remove a finished request from the engine and return it."""
        request = self.get_request(request_id)
        if not request.finished:
            raise ValueError(f"request {request_id!r} has not finished")
        del self.requests[request_id]
        return request

    async def run_engine(self, *, loop: Optional[asyncio.AbstractEventLoop] = None):
        """Step whenever there is work, until :meth:`shutdown`; run it as a task on a single-rank server's event
        loop (each step runs synchronously on the loop, yielding between steps)."""
        self.state = EngineState.RUNNING
        while self.state not in (EngineState.STOPPING, EngineState.STOPPED):
            if self.has_unfinished_requests():
                self.step_modern()
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.002)
        self.state = EngineState.STOPPED

    def shutdown(self) -> None:
        """Stop :meth:`run_engine` after its current step."""
        self.state = EngineState.STOPPING

    def reset(self) -> None:
        """Drop every request and free the whole KV cache (requests in flight are failed)."""
        for request_id in list(self.requests):
            request = self.get_request(request_id)
            if not request.finished:
                request.status = Status.FAILED
                request.add_event(DynamicInferenceEventType.FAIL, "engine reset")
                self._notify(request, finished=True)
        self.requests.clear()
        self.waiting.clear()
        self.active.clear()
        self.context.reset()
        self.step_count = 0

    def wait_until(self, state: EngineState):
        """Block until the engine reaches ``state`` (e.g. STOPPED after :meth:`shutdown`, from another thread)."""
        while self.state is not state:
            time.sleep(0.001)

    def suspend(self):
        """Refuse new requests until :meth:`resume` (requests already queued keep running)."""
        self.state = EngineState.SUSPENDED

    def resume(self):
        self.state = EngineState.RUNNING


def _resolve(future: asyncio.Future, request: DynamicInferenceRequest) -> None:
    if not future.done():
        future.set_result(request)
