"""Run one validated request on the serving loop: ``n`` choices per prompt, their text pieces as they come.

:class:`Generation` submits every choice (choice ``i * n + j`` is prompt ``i``'s ``j``-th sample, OpenAI's order),
merges their progress into one stream of :class:`ChoiceUpdate`\\ s and counts the usage. The endpoints turn the
updates into OpenAI's JSON (all at once) or its server-sent events (as they arrive).
"""

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, List, Optional

from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_server.errors import SERVER_ERROR, OpenAIError
from megatron.core.inference.text_generation_server.serving_loop import ServingLoop
from megatron.core.inference.text_generation_server.text_stream import TextStream
from megatron.core.inference.text_generation_server.validation import GenerationRequest


@dataclass
class ChoiceUpdate:
    """New text of one choice, the tokens behind it (with log-probs when asked), and its finish reason once done."""

    index: int
    text: str = ""
    tokens: List[int] = field(default_factory=list)
    log_probs: List[float] = field(default_factory=list)
    top_logprobs: List[Dict[str, float]] = field(default_factory=list)
    finish_reason: Optional[str] = None


def sampling_params_for(request: GenerationRequest, choice: int, termination_id: Optional[int]) -> SamplingParams:
    """Megatron SamplingParams of one choice. With a seed, choice ``j`` samples with ``seed + j``, so the ``n``
    choices differ from each other and each is reproducible."""
    want_logprobs = request.logprobs is not None
    return SamplingParams(
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        num_tokens_to_generate=request.max_tokens,
        return_log_probs=want_logprobs,
        skip_prompt_log_probs=not (want_logprobs and request.echo),
        top_n_logprobs=request.logprobs or 0,
        termination_id=termination_id,
        stop_words=list(request.stop) or None,
        seed=None if request.seed is None else request.seed + choice,
    )


class Generation:
    """All choices of one request, run concurrently on the engine (the engine batches them with everything else)."""

    def __init__(self, serving_loop: ServingLoop, request: GenerationRequest, tokenizer, termination_id: Optional[int]):
        self.request = request
        self.tokenizer = tokenizer
        self.prompt_tokens = sum(len(p) for p in request.prompts)
        self.completion_tokens = 0
        self.prompt_log_probs: Dict[int, List[float]] = {}  # per prompt index, when echo asks for them
        self._streams: List[TextStream] = []
        self._handles = []
        self._serving_loop = serving_loop
        self._ended = set()  # choices whose engine request ended (finished or failed): nothing to cancel
        try:
            params = [sampling_params_for(request, sample, termination_id) for sample in range(request.n)]
        except ValueError as error:  # a combination SamplingParams refuses
            raise OpenAIError(str(error), code="invalid_value") from None
        for prompt_index, prompt in enumerate(request.prompts):
            for sample in range(request.n):
                self._handles.append((prompt_index, serving_loop.submit(prompt, params[sample])))
                self._streams.append(TextStream(tokenizer, request.stop, [termination_id]))

    def cancel(self) -> None:
        """The client went away: cancel every choice still running, so the engine frees their slots now."""
        for index, (_, handle) in enumerate(self._handles):
            if index not in self._ended:
                self._ended.add(index)
                self._serving_loop.cancel(handle.request_id)

    @property
    def num_choices(self) -> int:
        return len(self._handles)

    def prompt_index(self, choice: int) -> int:
        return choice // self.request.n

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Every choice's updates, interleaved as the engine produces them; each choice ends with one update
        carrying its finish_reason. An engine error raises :class:`OpenAIError`."""
        merged: asyncio.Queue = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(self._follow(index, handle, merged))
            for index, (_, handle) in enumerate(self._handles)
        ]
        try:
            remaining = len(tasks)
            while remaining:
                update = await merged.get()
                if isinstance(update, BaseException):
                    raise update
                if update.finish_reason is not None:
                    remaining -= 1
                yield update
        finally:
            for task in tasks:
                task.cancel()

    async def _follow(self, index: int, handle, merged: asyncio.Queue) -> None:
        stream = self._streams[index]
        prompt_index = self.prompt_index(index)
        try:
            async for progress in handle:
                if progress.finished or progress.error is not None:
                    self._ended.add(index)
                if progress.error is not None:
                    status = 400 if progress.error_is_client_error else 500
                    merged.put_nowait(
                        OpenAIError(
                            progress.error,
                            status=status,
                            type="invalid_request_error" if status == 400 else SERVER_ERROR,
                            code=None if status == 400 else "engine_error",
                        )
                    )
                    return
                if progress.prompt_log_probs is not None:
                    self.prompt_log_probs.setdefault(prompt_index, progress.prompt_log_probs)
                self.completion_tokens += len(progress.tokens)
                update = self._update(stream, index, progress)
                merged.put_nowait(update)
                if update.finish_reason is not None:
                    # Done (the engine's later tokens, if a stop sequence ended the text first, are dropped).
                    return
        except Exception as error:  # pragma: no cover - a bug here must still end the response
            merged.put_nowait(error)

    @staticmethod
    def _update(stream: TextStream, index: int, progress) -> ChoiceUpdate:
        before = len(stream.tokens)
        text = stream.add(progress.tokens)
        if progress.finished and not stream.done:
            text += stream.flush()
        kept = len(stream.tokens) - before  # tokens that are part of the choice's text
        update = ChoiceUpdate(index=index, text=text, tokens=stream.tokens[before:])
        if progress.log_probs:
            update.log_probs = progress.log_probs[:kept]
            update.top_logprobs = progress.top_logprobs[:kept]
        if stream.done or progress.finished:
            update.finish_reason = stream.finish_reason or "length"
        return update
