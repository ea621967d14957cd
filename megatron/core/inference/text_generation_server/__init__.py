"""An OpenAI-compatible HTTP server over the dynamic inference engine (needs ``pip install -e ".[inference]"``).

``/v1/completions``, ``/v1/chat/completions`` (both also without ``/v1``, both streaming with ``stream: true``),
``/v1/models``, ``/health``, and Megatron's legacy ``PUT /api``; see docs/inference.md. The pieces, in the order a
request meets them: :mod:`.app` (the app and its errors), :mod:`.routes` (the handlers), :mod:`.validation`
(request bodies), :mod:`.generation` (choices on the engine), :mod:`.serving_loop` (the engine thread and the
model-parallel lockstep), :mod:`.text_stream` (tokens to text), :mod:`.responses` (OpenAI's JSON), :mod:`.server`
(uvicorn).
"""

from megatron.core.inference.text_generation_server.errors import OpenAIError
from megatron.core.inference.text_generation_server.serving_loop import ServingLoop
from megatron.core.inference.text_generation_server.validation import GenerationRequest, ServingDefaults

__all__ = ["OpenAIError", "ServingLoop", "GenerationRequest", "ServingDefaults", "TextGenerationServer", "create_app"]


def __getattr__(name):
    # FastAPI and uvicorn are optional: import them only when the server itself is asked for.
    if name == "TextGenerationServer":
        from megatron.core.inference.text_generation_server.server import TextGenerationServer

        return TextGenerationServer
    if name == "create_app":
        from megatron.core.inference.text_generation_server.app import create_app

        return create_app
    raise AttributeError(name)
