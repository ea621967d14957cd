"""The server's routes, as an ``APIRouter`` of top-level handlers: OpenAI's completions, chat completions and models
endpoints, health, and Megatron's legacy ``PUT /api``.

Every handler reads its body with :mod:`.validation` (a bad request is answered 4xx with OpenAI's error body before
the engine sees it), hands the request to the :class:`~.serving_loop.ServingLoop` through a
:class:`~.generation.Generation`, and answers with :mod:`.responses`' shapes, either whole or as server-sent events
ending in ``data: [DONE]``. What a handler needs of its app (engine, tokenizer, model name, request parser) is the
:class:`ServerState` that :func:`~.app.create_app` puts in ``app.state.server``.

One event loop serves every client, so nothing slow runs on it: JSON parsing, chat-template rendering and
tokenization run on worker threads (at most ``PARSE_THREADS`` at once, so a burst of big requests cannot take every
thread), and the handlers and their dependencies are ``async``, so ``/health`` never waits for a thread. A client
that disconnects before its answer is complete has its generation cancelled, which frees its engine slot.
"""

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Dict, List, Optional

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from megatron.core.inference.text_generation_server import responses
from megatron.core.inference.text_generation_server.errors import NOT_FOUND, SERVER_ERROR, OpenAIError
from megatron.core.inference.text_generation_server.generation import Generation
from megatron.core.inference.text_generation_server.serving_loop import ServingLoop
from megatron.core.inference.text_generation_server.validation import (
    GenerationRequest,
    RequestParser,
    parse_json_body,
)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PARSE_THREADS = 4
# nginx's "client closed request": what a handler returns when no one is left to read its answer.
_CLIENT_CLOSED_REQUEST = 499


@dataclass
class ServerState:
    """One app's engine and settings, shared by its handlers."""

    serving_loop: ServingLoop
    tokenizer: object
    model_name: str
    max_sequence_length: int
    parser: RequestParser
    termination_id: Optional[int]
    created: int  # when the app was built: the model card's "created"
    parse_threads: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(PARSE_THREADS))

    async def read(self, http_request: Request, kind: str) -> GenerationRequest:
        """The body of ``http_request`` read as a request of ``kind`` ("completion", "chat_completion" or
        "legacy"): received on the event loop (bounded by the app's body limit), parsed on a worker thread."""
        raw = await http_request.body()
        read = getattr(self.parser, kind)
        return await anyio.to_thread.run_sync(lambda: read(parse_json_body(raw)), limiter=self.parse_threads)

    def generation(self, request: GenerationRequest) -> Generation:
        """A generation on the engine, or a 503 when the engine has stopped."""
        if not self.serving_loop.running:
            raise OpenAIError(
                f"The inference engine is not running ({self.serving_loop.fatal_error or 'stopped'}).",
                status=503,
                type=SERVER_ERROR,
                code="engine_unavailable",
            )
        return Generation(self.serving_loop, request, self.tokenizer, self.termination_id)

    def model_card(self) -> Dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "megatron",
            "max_model_len": self.max_sequence_length,
        }


async def _server(request: Request) -> ServerState:
    # async: FastAPI would run a plain function on a worker thread, which a burst of big requests may all hold.
    return request.app.state.server


router = APIRouter()

# ---------------------------------------------------------------------------------------------- health and models


@router.get("/health")
@router.get("/v1/health")
async def health(state: ServerState = Depends(_server)):
    loop = state.serving_loop
    if not loop.running:
        return JSONResponse({"status": "unavailable", "error": str(loop.fatal_error)}, status_code=503)
    return {"status": "ok", "requests": {"in_engine": loop.requests_in_engine, "cancelled": loop.cancelled}}


@router.get("/v1/models")
async def models(state: ServerState = Depends(_server)):
    return {"object": "list", "data": [state.model_card()]}


@router.get("/v1/models/{model}")
async def model_by_id(model: str, state: ServerState = Depends(_server)):
    if model != state.model_name:
        raise OpenAIError(
            f"The model '{model}' does not exist; this server serves '{state.model_name}'.",
            status=404,
            type=NOT_FOUND,
            param="model",
            code="model_not_found",
        )
    return state.model_card()


# ---------------------------------------------------------------------------------------------- completions


@router.post("/v1/completions")
@router.post("/completions")
async def completions(http_request: Request, state: ServerState = Depends(_server)):
    request = await state.read(http_request, "completion")
    generation = state.generation(request)
    if request.stream:
        return _event_stream(state, generation, "cmpl", responses.completion_chunk, _completion_chunks)
    choices = await _collect(generation, http_request)
    if choices is None:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    body = [
        responses.completion_choice(
            c.index, _echoed(generation, c.index) + c.text, c.finish_reason, _completion_logprobs(state, generation, c)
        )
        for c in choices
    ]
    return _whole_response(state, generation, "cmpl", responses.completion_response, body)


def _echoed(generation: Generation, choice: int) -> str:
    request = generation.request
    return request.prompt_texts[generation.prompt_index(choice)] if request.echo else ""


def _completion_logprobs(
    state: ServerState, generation: Generation, choice: responses.ChoiceAccumulator
) -> Optional[dict]:
    request = generation.request
    if request.logprobs is None:
        return None
    tokens, log_probs, tops = list(choice.tokens), list(choice.log_probs), list(choice.top_logprobs)
    if request.echo:
        prompt = request.prompts[generation.prompt_index(choice.index)]
        prompt_lps = _prompt_log_probs(generation, generation.prompt_index(choice.index))
        tokens = list(prompt) + tokens
        log_probs = [None] + prompt_lps + log_probs
        tops = [None] * len(prompt) + tops
    return responses.completion_logprobs(state.tokenizer, tokens, log_probs, tops, request.logprobs)


async def _completion_chunks(state: ServerState, generation: Generation) -> AsyncIterator[list]:
    """The streamed choices of a completion: the echoed prompts first, then text, log-probs and finish reasons."""
    request = generation.request
    if request.echo:
        for index in range(generation.num_choices):
            yield [responses.completion_choice(index, _echoed(generation, index), None, None)]
    async for update in generation.updates():
        logprobs = None
        if request.logprobs is not None and update.tokens:
            logprobs = responses.completion_logprobs(
                state.tokenizer, update.tokens, update.log_probs, update.top_logprobs, request.logprobs
            )
        if update.text or update.finish_reason or logprobs:
            yield [responses.completion_choice(update.index, update.text, update.finish_reason, logprobs)]


# ---------------------------------------------------------------------------------------------- chat completions


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(http_request: Request, state: ServerState = Depends(_server)):
    request = await state.read(http_request, "chat_completion")
    generation = state.generation(request)
    if request.stream:
        return _event_stream(state, generation, "chatcmpl", responses.chat_chunk, _chat_chunks)
    choices = await _collect(generation, http_request)
    if choices is None:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    body = [
        responses.chat_choice(
            c.index, c.text, c.finish_reason, _chat_logprobs(state, request, c.tokens, c.log_probs, c.top_logprobs)
        )
        for c in choices
    ]
    return _whole_response(state, generation, "chatcmpl", responses.chat_response, body)


def _chat_logprobs(state: ServerState, request: GenerationRequest, tokens, log_probs, tops) -> Optional[dict]:
    if request.logprobs is None:
        return None
    return responses.chat_logprobs(state.tokenizer, tokens, log_probs, tops, request.logprobs)


async def _chat_chunks(state: ServerState, generation: Generation) -> AsyncIterator[list]:
    """The streamed choices of a chat completion: each choice's role first, then content deltas, then its finish."""
    request = generation.request
    for index in range(generation.num_choices):
        yield [responses.chat_delta(index, {"role": "assistant", "content": ""})]
    async for update in generation.updates():
        logprobs = None
        if update.tokens:
            logprobs = _chat_logprobs(state, request, update.tokens, update.log_probs, update.top_logprobs)
        if update.text or logprobs:
            yield [responses.chat_delta(update.index, {"content": update.text}, None, logprobs)]
        if update.finish_reason is not None:
            yield [responses.chat_delta(update.index, {}, update.finish_reason)]


# ---------------------------------------------------------------------------------------------- Megatron's legacy API


@router.put("/api")
async def legacy(http_request: Request, state: ServerState = Depends(_server)):
    """Megatron's text generation server API: ``{"prompts": [...], "tokens_to_generate": N, ...}`` ->
    ``{"text": [prompt + generation, ...], "segments": [[token, ...], ...], "logprobs": [[...], ...]}``."""
    request = await state.read(http_request, "legacy")
    generation = state.generation(request)
    choices = await _collect(generation, http_request)
    if choices is None:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    texts, segments, logprobs = [], [], []
    for choice in choices:
        prompt = request.prompts[choice.index]
        texts.append(request.prompt_texts[choice.index] + choice.text)
        segments.append([state.tokenizer.detokenize([t]) for t in list(prompt) + choice.tokens])
        if request.logprobs is not None:
            logprobs.append(_prompt_log_probs(generation, choice.index) + choice.log_probs)
    body = {"text": texts, "segments": segments}
    if request.logprobs is not None:
        body["logprobs"] = logprobs
    return body


# ---------------------------------------------------------------------------------------------- shared answers


def _whole_response(state: ServerState, generation: Generation, id_prefix: str, make_response: Callable, body):
    """A non-streamed completion or chat completion: its choices, a fresh id and the token usage."""
    return make_response(
        responses.new_id(id_prefix),
        responses.now(),
        state.model_name,
        body,
        responses.usage(generation.prompt_tokens, generation.completion_tokens),
    )


def _event_stream(
    state: ServerState, generation: Generation, id_prefix: str, make_chunk: Callable, chunks: Callable
) -> StreamingResponse:
    """Server-sent events: one chunk per list of choices ``chunks(state, generation)`` yields, then the usage when
    asked for, then ``[DONE]``. Headers are already sent, so a failure mid-stream becomes an error event. When the
    client disconnects, Starlette cancels this generator and the generation is cancelled with it."""

    async def events():
        request = generation.request
        # Id and time are fixed when the stream starts, as for a whole response.
        response_id, when = responses.new_id(id_prefix), responses.now()

        def chunk(choices, usage_counts=None):
            return responses.sse(
                make_chunk(response_id, when, state.model_name, choices, usage_counts, request.include_usage)
            )

        complete = False
        try:
            async for choices in chunks(state, generation):
                yield chunk(choices)
            if request.include_usage:
                yield chunk([], responses.usage(generation.prompt_tokens, generation.completion_tokens))
            complete = True
        except OpenAIError as error:
            yield responses.sse(error.body())
        finally:
            if not complete:  # the client went away, or a choice failed: the other choices have no one to go to
                generation.cancel()
        yield responses.SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)


def _prompt_log_probs(generation: Generation, prompt_index: int) -> List[Optional[float]]:
    """Log-probs of prompt tokens 2.. (the first has none), None where the engine reported none."""
    count = len(generation.request.prompts[prompt_index]) - 1
    values = list(generation.prompt_log_probs.get(prompt_index, []))[:count]
    return values + [None] * (count - len(values))


async def _collect(generation: Generation, http_request: Request) -> Optional[List[responses.ChoiceAccumulator]]:
    """Every choice, whole; None (and the generation cancelled) when the client disconnects first."""
    choices = [responses.ChoiceAccumulator(index) for index in range(generation.num_choices)]

    async def gather():
        async for update in generation.updates():
            choices[update.index].add(update)

    collecting = asyncio.ensure_future(gather())
    disconnected = asyncio.ensure_future(_disconnect(http_request))
    try:
        await asyncio.wait((collecting, disconnected), return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not collecting.done():  # the client went away first (or this handler is being cancelled)
            collecting.cancel()
            generation.cancel()
    if not collecting.done():
        return None
    error = collecting.exception()
    if error is not None:
        generation.cancel()  # a choice failed: the others' text can no longer be sent
        raise error
    return choices


async def _disconnect(http_request: Request) -> None:
    """Returns when the client disconnects (the body is read, so the next ASGI message is the disconnect)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
