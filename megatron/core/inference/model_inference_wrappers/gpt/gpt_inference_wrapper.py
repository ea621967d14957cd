"""GPTModel at inference: token and position inputs for a context window of a padded batch."""

from typing import Any, Dict, Optional

import torch

from megatron.core.inference.contexts.base_context import BaseInferenceContext
from megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
    AbstractModelInferenceWrapper,
)
from megatron.core.models.gpt.gpt_model import GPTModel


class GPTInferenceWrapper(AbstractModelInferenceWrapper):
    """``GPTInferenceWrapper(model, inference_context)``: causal attention comes from the layers' mask type and
    the context, so no attention mask tensor is built; positions are ``0 .. s - 1`` per row."""

    def __init__(self, model: GPTModel, inference_context: Optional[BaseInferenceContext] = None):
        super().__init__(model, inference_context)

    def prep_inference_input(self, prompts_tokens: torch.Tensor) -> Dict[str, Any]:
        batch, seq = prompts_tokens.shape
        position_ids = torch.arange(seq, device=prompts_tokens.device).unsqueeze(0).expand(batch, seq)
        return {"tokens": prompts_tokens, "position_ids": position_ids, "attention_mask": None}

    def get_batch_for_context_window(
        self, inference_input: Dict[str, Any], context_start_position: int, context_end_position: int
    ) -> Dict[str, Any]:
        window = slice(context_start_position, context_end_position)
        return {
            "tokens": inference_input["tokens"][:, window],
            "position_ids": inference_input["position_ids"][:, window],
            "attention_mask": None,
        }
