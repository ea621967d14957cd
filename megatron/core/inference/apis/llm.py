"""``MegatronLLM``: offline generation in three lines.

    llm = MegatronLLM(model=model, tokenizer=tokenizer)
    requests = llm.generate(["Hello", "The capital of France is"], SamplingParams(num_tokens_to_generate=32))
    print(requests[0].generated_text)

It builds the GPT wrapper, the controller, a dynamic context sized by ``inference_config`` and a
:class:`DynamicInferenceEngine`. Under tensor/pipeline parallelism every rank calls ``generate`` together (the
first rank's prompts are used; every rank gets the results).
"""

import logging
import math
from typing import List, Optional, Union

from megatron.core.inference.config import InferenceConfig
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.inference_request import DynamicInferenceRequest
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron.core.utils import get_attr_wrapped_model, get_model_config

logger = logging.getLogger(__name__)


class MegatronLLM:
    """Offline LLM over a Megatron GPT model.

    ``use_coordinator`` / ``coordinator_host`` / ``coordinator_port`` concern Megatron's data-parallel request
    coordinator, which is not built here: one model replica serves the requests directly, so they are accepted
    and do not change anything.
    """

    def __init__(
        self,
        *,
        model,
        tokenizer,
        inference_config: Optional[InferenceConfig] = None,
        use_coordinator: bool = True,
        coordinator_host: Optional[str] = None,
        coordinator_port: Optional[int] = None,
    ) -> None:
        config = inference_config or InferenceConfig()
        model_config = get_model_config(model[0] if isinstance(model, (list, tuple)) else model)
        max_sequence_length = config.max_sequence_length or get_attr_wrapped_model(
            model[0] if isinstance(model, (list, tuple)) else model, "max_sequence_length"
        )
        num_blocks = config.num_blocks
        if num_blocks is None and config.buffer_size_gb is None:
            num_blocks = config.max_requests * math.ceil(max_sequence_length / config.block_size_tokens)
        self.context = DynamicInferenceContext(
            params_dtype=model_config.params_dtype,
            num_layers=model_config.num_layers,
            kv_channels=model_config.kv_channels,
            num_attention_heads=model_config.num_query_groups,
            max_sequence_length=max_sequence_length,
            buffer_size_gb=config.buffer_size_gb,
            block_size_tokens=config.block_size_tokens,
            max_requests=config.max_requests,
            max_tokens=config.max_tokens,
            num_blocks=num_blocks,
        )
        self.wrapper = GPTInferenceWrapper(model, self.context)
        self.controller = TextGenerationController(self.wrapper, tokenizer)
        if config.random_seed is not None:
            self.controller.sampling_rng.manual_seed(config.random_seed)
        self.engine = DynamicInferenceEngine(self.controller, self.context)
        self.inference_config = config

    def generate(
        self,
        prompts: Union[str, List[int], List[str], List[List[int]]],
        sampling_params: Optional[SamplingParams] = None,
    ) -> List["DynamicInferenceRequest"]:
        """One finished request per prompt (a single string or token list counts as one prompt)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.engine.generate(list(prompts), sampling_params or SamplingParams())

    def pause(self) -> None:
        """Stop admitting requests (``unpause`` admits again)."""
        self.engine.suspend()

    def unpause(self) -> None:
        self.engine.resume()

    def suspend(self) -> None:
        self.engine.suspend()

    def resume(self) -> None:
        self.engine.resume()

    def shutdown(self) -> None:
        """Drop every request and free the KV cache."""
        self.engine.reset()
        self.engine.shutdown()

    def wait_for_shutdown(self) -> None:
        """Nothing runs in the background here: ``shutdown`` is complete when it returns."""
