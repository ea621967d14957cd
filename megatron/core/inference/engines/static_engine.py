"""The static engine: batches of requests, each batch run to completion before the next starts.

``StaticInferenceEngine(controller, max_batch_size)`` groups queued requests into batches of at most
``max_batch_size`` and runs each with a padded static KV cache (``legacy=True``, or a controller whose wrapper has
no dynamic context). With ``legacy=False`` and a wrapper holding a :class:`DynamicInferenceContext`, ``generate``
hands the prompts to a :class:`DynamicInferenceEngine` over that context instead (Megatron's default route).
"""

import asyncio
from collections import OrderedDict
from typing import AsyncGenerator, Dict, List, Optional

import torch

from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines.abstract_engine import AbstractEngine, RequestStreams
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)


class StaticInferenceEngine(AbstractEngine):
    """Args:
    text_generation_controller: the controller (its wrapper holds the model).
    max_batch_size: most requests per batch (default 8).
    random_seed: seeds the generator that requests without their own ``seed`` sample from.
    legacy: always use the static path, even when the wrapper has a dynamic context.
    buffer_size_gb: accepted for Megatron's signature; the dynamic route uses the wrapper's context as sized.
    """

    def __init__(
        self,
        text_generation_controller: TextGenerationController,
        max_batch_size: Optional[int] = None,
        random_seed: Optional[int] = None,
        legacy=False,
        buffer_size_gb: Optional[float] = 40,
    ):
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"StaticInferenceEngine: max_batch_size must be >= 1, got {max_batch_size}")
        self.controller = text_generation_controller
        self.text_generation_controller = text_generation_controller
        self.max_batch_size = max_batch_size or 8
        self.random_seed = random_seed
        if random_seed is not None:
            torch.manual_seed(random_seed)
            self.controller.sampling_rng.manual_seed(random_seed)
        self.legacy = legacy
        self.buffer_size_gb = buffer_size_gb
        self.waiting: "OrderedDict[str, InferenceRequest]" = OrderedDict()
        self.completed: Dict[str, InferenceRequest] = {}
        self._streams = RequestStreams()
        self._next_id = 0
        self._dynamic_engine: Optional[DynamicInferenceEngine] = None

    def get_new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def add_request(
        self,
        prompt: Optional[str] = None,
        add_BOS: bool = False,
        encoder_prompt: Optional[str] = None,
        sampling_params: Optional[SamplingParams] = None,
        streaming: bool = False,
        inference_request: Optional[InferenceRequest] = None,
        *,
        inference_parameters: Optional[SamplingParams] = None,
    ) -> int:
        """Queue a prompt (or a ready ``inference_request``); returns its request id. With ``streaming``,
        :meth:`get_stream_generator` yields the request after each new token."""
        if encoder_prompt is not None:
            raise ValueError("encoder_prompt is for encoder-decoder models; GPT models take only a prompt")
        if inference_request is None:
            if prompt is None:
                raise ValueError("add_request needs a prompt or an inference_request")
            sampling_params = sampling_params or inference_parameters or SamplingParams()
            sampling_params.validate()
            tokens = self.controller.tokenize_prompt(
                self.controller.tokenizer, prompt, add_BOS or sampling_params.add_BOS
            )
            inference_request = InferenceRequest(
                request_id=self.get_new_request_id(),
                prompt=prompt,
                sampling_params=sampling_params,
                prompt_tokens=tokens,
            )
        if inference_request.sampling_params is None:
            inference_request.sampling_params = SamplingParams()
        if inference_request.prompt_tokens is None:
            inference_request.prompt_tokens = self.controller.tokenize_prompt(
                self.controller.tokenizer, inference_request.prompt, add_BOS
            )
            inference_request.prompt_length = len(inference_request.prompt_tokens)
        inference_request.status = Status.WAITING_IN_QUEUE
        self.waiting[inference_request.request_id] = inference_request
        if streaming:
            self._streams.expect(inference_request.request_id)
        return inference_request.request_id

    def get_stream_generator(self, request_id: int) -> Optional[AsyncGenerator[InferenceRequest, None]]:
        """Async generator of the request after each new token (for a request added with ``streaming=True``;
        None otherwise). Consume it on the loop running :meth:`run_engine_async`."""
        if request_id not in self._streams:
            return None
        return self._streams.open(request_id)

    def _run_one_batch(self) -> None:
        batch = OrderedDict()
        while self.waiting and len(batch) < self.max_batch_size:
            request_id, request = self.waiting.popitem(last=False)
            batch[request_id] = request
        callbacks = {rid: (lambda r: self._streams.push(r, False)) for rid in batch if rid in self._streams}
        self.controller.generate_all_output_tokens_static_batch(batch, callbacks)
        for request_id, request in batch.items():
            self.completed[request_id] = request
            self._streams.push(request, True)

    def run_engine(self):
        """Run every queued request to completion, batch by batch."""
        while self.waiting:
            self._run_one_batch()

    async def run_engine_async(self, loop: Optional[asyncio.AbstractEventLoop] = None):
        """:meth:`run_engine`, yielding to the event loop between batches."""
        while self.waiting:
            self._run_one_batch()
            await asyncio.sleep(0)

    def generate(
        self,
        prompts: Optional[List[str]] = None,
        add_BOS: bool = False,
        encoder_prompts: Optional[List[str]] = None,
        common_inference_params: Optional[SamplingParams] = None,
        sampling_params: Optional[SamplingParams] = None,
        inference_requests: Optional[List[InferenceRequest]] = None,
    ) -> List[InferenceRequest]:
        """Generate for ``prompts`` (or ready ``inference_requests``) and return the finished requests in order.
        Under model parallelism every rank calls it with the same prompts."""
        context = self.controller.inference_wrapped_model.inference_context
        if not self.legacy and isinstance(context, DynamicInferenceContext):
            return self.generate_using_dynamic_engine(
                prompts, add_BOS, encoder_prompts, common_inference_params, sampling_params, inference_requests
            )
        return self.generate_using_legacy_static_engine(
            prompts, add_BOS, encoder_prompts, common_inference_params, sampling_params, inference_requests
        )

    def generate_using_legacy_static_engine(
        self,
        prompts: Optional[List[str]] = None,
        add_BOS: bool = False,
        encoder_prompts: Optional[List[str]] = None,
        common_inference_params: Optional[SamplingParams] = None,
        sampling_params: Optional[SamplingParams] = None,
        inference_requests: Optional[List[InferenceRequest]] = None,
    ) -> List[InferenceRequest]:
        sampling_params = sampling_params or common_inference_params or SamplingParams()
        if encoder_prompts is not None:
            raise ValueError("encoder_prompts are for encoder-decoder models; GPT models take only prompts")
        if inference_requests is not None:
            ids = [self.add_request(inference_request=r) for r in inference_requests]
        else:
            if not prompts:
                raise ValueError("generate needs prompts or inference_requests")
            ids = [self.add_request(p, add_BOS=add_BOS, sampling_params=sampling_params) for p in prompts]
        self.run_engine()
        return [self.completed.pop(request_id) for request_id in ids]

    def generate_using_dynamic_engine(
        self,
        prompts: Optional[List[str]] = None,
        add_BOS: bool = False,
        encoder_prompts: Optional[List[str]] = None,
        common_inference_params: Optional[SamplingParams] = None,
        sampling_params: Optional[SamplingParams] = None,
        inference_requests: Optional[List[InferenceRequest]] = None,
    ) -> List[InferenceRequest]:
        """Generate through a :class:`DynamicInferenceEngine` over the wrapper's dynamic context."""
        if encoder_prompts is not None:
            raise ValueError("encoder_prompts are for encoder-decoder models; GPT models take only prompts")
        sampling_params = sampling_params or common_inference_params or SamplingParams()
        if add_BOS:
            sampling_params.add_BOS = True
        if self._dynamic_engine is None:
            self._dynamic_engine = DynamicInferenceEngine(
                self.controller, self.controller.inference_wrapped_model.inference_context
            )
        if inference_requests is not None:
            prompts = [r.prompt_tokens if r.prompt_tokens is not None else r.prompt for r in inference_requests]
        return self._dynamic_engine.generate(prompts, sampling_params)
