"""The FastAPI application: the routes of :mod:`.routes` over one engine, and OpenAI-shaped errors.

Unknown routes and wrong methods get OpenAI's error body too, and an unexpected failure in a handler is a 500 for
that request only: the server keeps serving. Request bodies are bounded (:class:`RequestBodyLimit`): a body over
the limit is a 413 before it is read, or as soon as the limit is passed when its length is not declared.
"""

import logging
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from megatron.core.inference.text_generation_server import responses
from megatron.core.inference.text_generation_server.errors import NOT_FOUND, SERVER_ERROR, OpenAIError, error_body
from megatron.core.inference.text_generation_server.routes import ServerState, router
from megatron.core.inference.text_generation_server.serving_loop import ServingLoop
from megatron.core.inference.text_generation_server.validation import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    RequestParser,
    ServingDefaults,
)

logger = logging.getLogger(__name__)


def create_app(
    serving_loop: ServingLoop,
    tokenizer,
    model_name: str,
    max_sequence_length: int,
    defaults: Optional[ServingDefaults] = None,
    render_chat: Optional[Callable] = None,
    termination_id: Optional[int] = None,
    vocab_size: Optional[int] = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    ignore_unknown_fields: bool = False,
) -> FastAPI:
    """The server's app. ``max_sequence_length`` bounds prompt + generated tokens; ``termination_id`` (default: the
    tokenizer's end-of-document id) ends a generation; ``render_chat`` turns chat messages into prompt text.
    ``max_request_body_bytes`` bounds request bodies (0: no bound); ``ignore_unknown_fields`` accepts request
    fields the endpoint does not know instead of refusing them."""
    from megatron.core.inference.text_generation_server.chat_template import default_chat_prompt

    if max_request_body_bytes < 0:
        raise ValueError(f"max_request_body_bytes={max_request_body_bytes}: need >= 0 (0: no bound)")
    if termination_id is None:
        termination_id = getattr(tokenizer, "eod", None)
    parser = RequestParser(
        tokenizer,
        max_sequence_length,
        defaults,
        render_chat or default_chat_prompt,
        vocab_size,
        ignore_unknown_fields=ignore_unknown_fields,
    )
    app = FastAPI(title="Megatron text generation server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(
        serving_loop, tokenizer, model_name, max_sequence_length, parser, termination_id, created=responses.now()
    )
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.include_router(router)
    if max_request_body_bytes:
        app.add_middleware(RequestBodyLimit, max_bytes=max_request_body_bytes)
    return app


class RequestBodyLimit:
    """ASGI middleware: a 413 with OpenAI's error body for a request body over ``max_bytes``.

    A declared ``Content-Length`` over the limit is answered before a byte of the body is read; a body without one
    (chunked upload) is counted as it arrives and refused once it passes the limit, so at most ``max_bytes`` plus
    one chunk is ever held. Either way the oversized body is never buffered whole: uvicorn reads the rest and
    discards it, so a client that sends its whole body before reading the answer (most do) still gets the 413
    rather than a reset connection."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = self._too_large(f"The request body is {int(declared)} bytes, over")
            response = JSONResponse(error.body(), status_code=413)
            return await response(scope, receive, send)
        received = 0

        async def bounded_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the handler's body read: the app's OpenAIError handler answers it.
                    raise self._too_large("The request body (sent without a Content-Length) is longer than")
            return message

        await self.app(scope, bounded_receive, send)

    def _too_large(self, what: str) -> OpenAIError:
        return OpenAIError(
            f"{what} this server's limit of {self.max_bytes} bytes. Send a smaller request "
            "(fewer or shorter prompts), or start the server with a larger --max-request-body-bytes.",
            status=413,
            code="request_too_large",
        )


async def _openai_error(_request: Request, error: OpenAIError):
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(request: Request, error: StarletteHTTPException):
    if error.status_code == 404:
        message = f"Unknown endpoint {request.method} {request.url.path}; see docs/inference.md for the routes."
        return JSONResponse(error_body(message, type=NOT_FOUND, code="unknown_url"), status_code=404)
    if error.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}."
        return JSONResponse(error_body(message, code="method_not_allowed"), status_code=405)
    return JSONResponse(error_body(str(error.detail)), status_code=error.status_code)


async def _unexpected(_request: Request, error: Exception):
    logger.exception("request failed")
    return JSONResponse(
        error_body(f"The server failed on this request: {type(error).__name__}: {error}", type=SERVER_ERROR),
        status_code=500,
    )
