"""The FastAPI application: OpenAI's completions, chat completions and models endpoints, health, and Megatron's
legacy ``PUT /api``.

Every handler reads its body with :mod:`.validation` (a bad request is answered 4xx with OpenAI's error body before
the engine sees it), hands the request to the :class:`~.serving_loop.ServingLoop` through a
:class:`~.generation.Generation`, and answers with :mod:`.responses`' shapes, either whole or as server-sent events
ending in ``data: [DONE]``. Unknown routes and wrong methods get OpenAI's error body too, and an unexpected failure
in a handler is a 500 for that request only: the server keeps serving.
"""

import logging
from typing import Callable, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from megatron.core.inference.text_generation_server import responses
from megatron.core.inference.text_generation_server.errors import (
    NOT_FOUND,
    SERVER_ERROR,
    OpenAIError,
    error_body,
)
from megatron.core.inference.text_generation_server.generation import Generation
from megatron.core.inference.text_generation_server.serving_loop import ServingLoop
from megatron.core.inference.text_generation_server.validation import (
    GenerationRequest,
    RequestParser,
    ServingDefaults,
    parse_json_body,
)

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(
    serving_loop: ServingLoop,
    tokenizer,
    model_name: str,
    max_sequence_length: int,
    defaults: Optional[ServingDefaults] = None,
    render_chat: Optional[Callable] = None,
    termination_id: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> FastAPI:
    """The server's app. ``max_sequence_length`` bounds prompt + generated tokens; ``termination_id`` (default: the
    tokenizer's end-of-document id) ends a generation; ``render_chat`` turns chat messages into prompt text."""
    from megatron.core.inference.text_generation_server.chat_template import default_chat_prompt

    if termination_id is None:
        termination_id = getattr(tokenizer, "eod", None)
    parser = RequestParser(
        tokenizer, model_name, max_sequence_length, defaults, render_chat or default_chat_prompt, vocab_size
    )
    app = FastAPI(title="Megatron text generation server", docs_url=None, redoc_url=None, openapi_url=None)
    created = responses.now()

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        if error.status_code == 404:
            message = f"Unknown endpoint {request.method} {request.url.path}; see docs/inference.md for the routes."
            return JSONResponse(error_body(message, type=NOT_FOUND, code="unknown_url"), status_code=404)
        if error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}."
            return JSONResponse(error_body(message, code="method_not_allowed"), status_code=405)
        return JSONResponse(error_body(str(error.detail)), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, error: Exception):
        logger.exception("request failed")
        return JSONResponse(
            error_body(f"The server failed on this request: {type(error).__name__}: {error}", type=SERVER_ERROR),
            status_code=500,
        )

    def _generation(request: GenerationRequest) -> Generation:
        if not serving_loop.running:
            raise OpenAIError(
                f"The inference engine is not running ({serving_loop.fatal_error or 'stopped'}).",
                status=503,
                type=SERVER_ERROR,
                code="engine_unavailable",
            )
        return Generation(serving_loop, request, tokenizer, termination_id)

    # -------------------------------------------------------------- health and models

    def _health():
        if not serving_loop.running:
            return JSONResponse({"status": "unavailable", "error": str(serving_loop.fatal_error)}, status_code=503)
        return {"status": "ok"}

    app.get("/health")(_health)
    app.get("/v1/health")(_health)

    def _model_card() -> Dict:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "megatron",
            "max_model_len": max_sequence_length,
        }

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model}")
    async def _model(model: str):
        if model != model_name:
            raise OpenAIError(
                f"The model '{model}' does not exist; this server serves '{model_name}'.",
                status=404,
                type=NOT_FOUND,
                param="model",
                code="model_not_found",
            )
        return _model_card()

    # -------------------------------------------------------------- completions

    async def _completions(http_request: Request):
        request = parser.completion(parse_json_body(await http_request.body()))
        generation = _generation(request)
        if request.stream:
            return StreamingResponse(
                _stream_completion(generation), media_type="text/event-stream", headers=_SSE_HEADERS
            )
        choices = await _collect(generation)
        body = [
            responses.completion_choice(
                c.index, _echoed(generation, c.index) + c.text, c.finish_reason, _completion_logprobs(generation, c)
            )
            for c in choices
        ]
        return responses.completion_response(
            responses.new_id("cmpl"),
            responses.now(),
            model_name,
            body,
            responses.usage(generation.prompt_tokens, generation.completion_tokens),
        )

    app.post("/v1/completions")(_completions)
    app.post("/completions")(_completions)

    def _echoed(generation: Generation, choice: int) -> str:
        request = generation.request
        return request.prompt_texts[generation.prompt_index(choice)] if request.echo else ""

    def _completion_logprobs(generation: Generation, choice: responses.ChoiceAccumulator) -> Optional[dict]:
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
        return responses.completion_logprobs(tokenizer, tokens, log_probs, tops, request.logprobs)

    async def _stream_completion(generation: Generation):
        request = generation.request
        response_id, when = responses.new_id("cmpl"), responses.now()

        def chunk(choices, usage_counts=None):
            return responses.sse(
                responses.completion_chunk(response_id, when, model_name, choices, usage_counts, request.include_usage)
            )

        try:
            if request.echo:
                for index in range(generation.num_choices):
                    yield chunk([responses.completion_choice(index, _echoed(generation, index), None, None)])
            async for update in generation.updates():
                logprobs = None
                if request.logprobs is not None and update.tokens:
                    logprobs = responses.completion_logprobs(
                        tokenizer, update.tokens, update.log_probs, update.top_logprobs, request.logprobs
                    )
                if update.text or update.finish_reason or logprobs:
                    yield chunk(
                        [responses.completion_choice(update.index, update.text, update.finish_reason, logprobs)]
                    )
            if request.include_usage:
                yield chunk([], responses.usage(generation.prompt_tokens, generation.completion_tokens))
        except OpenAIError as error:
            yield responses.sse(error.body())
        yield responses.SSE_DONE

    # -------------------------------------------------------------- chat completions

    async def _chat_completions(http_request: Request):
        request = parser.chat_completion(parse_json_body(await http_request.body()))
        generation = _generation(request)
        if request.stream:
            return StreamingResponse(_stream_chat(generation), media_type="text/event-stream", headers=_SSE_HEADERS)
        choices = await _collect(generation)
        body = [
            responses.chat_choice(
                c.index, c.text, c.finish_reason, _chat_logprobs(request, c.tokens, c.log_probs, c.top_logprobs)
            )
            for c in choices
        ]
        return responses.chat_response(
            responses.new_id("chatcmpl"),
            responses.now(),
            model_name,
            body,
            responses.usage(generation.prompt_tokens, generation.completion_tokens),
        )

    app.post("/v1/chat/completions")(_chat_completions)
    app.post("/chat/completions")(_chat_completions)

    def _chat_logprobs(request: GenerationRequest, tokens, log_probs, tops) -> Optional[dict]:
        if request.logprobs is None:
            return None
        return responses.chat_logprobs(tokenizer, tokens, log_probs, tops, request.logprobs)

    async def _stream_chat(generation: Generation):
        request = generation.request
        response_id, when = responses.new_id("chatcmpl"), responses.now()

        def chunk(choices, usage_counts=None):
            return responses.sse(
                responses.chat_chunk(response_id, when, model_name, choices, usage_counts, request.include_usage)
            )

        try:
            for index in range(generation.num_choices):
                yield chunk([responses.chat_delta(index, {"role": "assistant", "content": ""})])
            async for update in generation.updates():
                logprobs = None
                if update.tokens:
                    logprobs = _chat_logprobs(request, update.tokens, update.log_probs, update.top_logprobs)
                if update.text or logprobs:
                    yield chunk([responses.chat_delta(update.index, {"content": update.text}, None, logprobs)])
                if update.finish_reason is not None:
                    yield chunk([responses.chat_delta(update.index, {}, update.finish_reason)])
            if request.include_usage:
                yield chunk([], responses.usage(generation.prompt_tokens, generation.completion_tokens))
        except OpenAIError as error:
            yield responses.sse(error.body())
        yield responses.SSE_DONE

    # -------------------------------------------------------------- Megatron's legacy PUT /api

    @app.put("/api")
    async def _legacy(http_request: Request):
        """Megatron's text generation server API: ``{"prompts": [...], "tokens_to_generate": N, ...}`` ->
        ``{"text": [prompt + generation, ...], "segments": [[token, ...], ...], "logprobs": [[...], ...]}``."""
        request = parser.legacy(parse_json_body(await http_request.body()))
        generation = _generation(request)
        choices = await _collect(generation)
        texts, segments, logprobs = [], [], []
        for choice in choices:
            prompt = request.prompts[choice.index]
            texts.append(request.prompt_texts[choice.index] + choice.text)
            segments.append([tokenizer.detokenize([t]) for t in list(prompt) + choice.tokens])
            if request.logprobs is not None:
                logprobs.append(_prompt_log_probs(generation, choice.index) + choice.log_probs)
        body = {"text": texts, "segments": segments}
        if request.logprobs is not None:
            body["logprobs"] = logprobs
        return body

    return app


def _prompt_log_probs(generation: Generation, prompt_index: int) -> List[Optional[float]]:
    """Log-probs of prompt tokens 2.. (the first has none), None where the engine reported none."""
    count = len(generation.request.prompts[prompt_index]) - 1
    values = list(generation.prompt_log_probs.get(prompt_index, []))[:count]
    return values + [None] * (count - len(values))


async def _collect(generation: Generation) -> List[responses.ChoiceAccumulator]:
    choices = [responses.ChoiceAccumulator(index) for index in range(generation.num_choices)]
    async for update in generation.updates():
        choices[update.index].add(update)
    return choices
