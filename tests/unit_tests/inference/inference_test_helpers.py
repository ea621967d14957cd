"""Small GPT / Llama models at any TP/PP layout and the no-cache greedy reference the engines are checked against."""

from typing import List

import torch

from megatron.core import parallel_state
from megatron.core.inference.contexts import DynamicInferenceContext
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.text_generation_controllers import TextGenerationController
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from tests.unit_tests.models.gpt_test_helpers import SEQ, VARIANTS, VOCAB, build_config

MAX_SEQ = 2 * SEQ
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [42]]
# The GPT test variants plus a Mixtral-like one: Llama with MoE MLPs (4 experts, top-2). Inference runs without
# sequence parallelism, which MoE accepts at TP > 1 outside training, as in Megatron.
MODELS = {
    **VARIANTS,
    "mixtral": dict(
        config={**VARIANTS["llama"]["config"], "num_moe_experts": 4, "moe_router_topk": 2},
        model=VARIANTS["llama"]["model"],
    ),
}


def tokenizer() -> NullTokenizer:
    return NullTokenizer(VOCAB - 1)  # ids 0..126 plus EOD 127: the model's 128 rows


def build_model(variant: str, tp: int = 1, pp: int = 1, seed: int = 1234) -> GPTModel:
    """The same weights at every layout (use_cpu_initialization draws each layer from its own stream)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(seed)
    spec = MODELS[variant]
    config = build_config(
        tp, False, {**spec["config"], "pipeline_model_parallel_size": pp, "pipeline_dtype": torch.float32}
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm),
        vocab_size=VOCAB,
        max_sequence_length=MAX_SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **spec["model"],
    ).eval()


@torch.no_grad()
def greedy_without_cache(model: GPTModel, prompt: List[int], num_tokens: int) -> List[int]:
    """Greedy decoding by a full forward over the whole sequence for every new token (single-process model)."""
    sequence = list(prompt)
    for _ in range(num_tokens):
        ids = torch.tensor([sequence])
        logits = model(ids, torch.arange(len(sequence))[None], None)
        sequence.append(int(logits[0, -1, : tokenizer().vocab_size].argmax()))
    return sequence[len(prompt) :]


@torch.no_grad()
def full_forward_log_probs(model: GPTModel, sequence: List[int]) -> torch.Tensor:
    """log p(sequence[i + 1] | sequence[: i + 1]) for every i, by one forward without a cache."""
    logits = model(torch.tensor([sequence]), torch.arange(len(sequence))[None], None)[0].float()
    log_probs = torch.log_softmax(logits[:, : tokenizer().vocab_size], dim=-1)
    return log_probs[:-1].gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]


def dynamic_setup(model, block_size_tokens=4, num_blocks=64, max_requests=16, max_tokens=16):
    context = DynamicInferenceContext(
        params_dtype=model.config.params_dtype,
        num_layers=model.config.num_layers,
        kv_channels=model.config.kv_channels,
        num_attention_heads=model.config.num_query_groups,
        max_sequence_length=MAX_SEQ,
        block_size_tokens=block_size_tokens,
        num_blocks=num_blocks,
        max_requests=max_requests,
        max_tokens=max_tokens,
    )
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer())
    return context, controller
