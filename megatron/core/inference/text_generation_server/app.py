"""The FastAPI application: the routes of :mod:`.routes` over one engine, and OpenAI-shaped errors.

Unknown routes and wrong methods get OpenAI's error body too, and an unexpected failure in a handler is a 500 for
that request only: the server keeps serving.
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
from megatron.core.inference.text_generation_server.validation import RequestParser, ServingDefaults

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
) -> FastAPI:
    """The server's app. ``max_sequence_length`` bounds prompt + generated tokens; ``termination_id`` (default: the
    tokenizer's end-of-document id) ends a generation; ``render_chat`` turns chat messages into prompt text."""
    from megatron.core.inference.text_generation_server.chat_template import default_chat_prompt

    if termination_id is None:
        termination_id = getattr(tokenizer, "eod", None)
    parser = RequestParser(tokenizer, max_sequence_length, defaults, render_chat or default_chat_prompt, vocab_size)
    app = FastAPI(title="Megatron text generation server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(
        serving_loop, tokenizer, model_name, max_sequence_length, parser, termination_id, created=responses.now()
    )
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.include_router(router)
    return app


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
