"""Greedy generation with the KV cache equals greedy decoding by full forward passes without a cache, token for
token, for GPT (learned positions) and Llama (RoPE, GQA, SwiGLU) at TP1, TP2 and PP2, and for a Mixtral-like MoE at
TP2 (without sequence parallelism), with both engines."""

import pytest

from tests.unit_tests.test_utilities import run_distributed

NEW_TOKENS = 8


def _generate_both_ways(variant: str, tp: int, pp: int):
    from megatron.core.inference.engines import DynamicInferenceEngine, StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers import TextGenerationController
    from tests.unit_tests.inference.inference_test_helpers import (
        PROMPTS,
        build_model,
        dynamic_setup,
        full_forward_log_probs,
        greedy_without_cache,
        tokenizer,
    )

    reference = build_model(variant)  # the single-process layout on every rank, no collectives
    expected = [greedy_without_cache(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]
    expected_log_probs = [
        full_forward_log_probs(reference, prompt + tokens)[len(prompt) - 1 :].tolist()
        for prompt, tokens in zip(PROMPTS, expected)
    ]
    model = build_model(variant, tp, pp)
    # termination_id -1: no token ends a request early, every request generates NEW_TOKENS.
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
    static = StaticInferenceEngine(TextGenerationController(GPTInferenceWrapper(model), tokenizer()), legacy=True)
    static_out = static.generate(prompts=[" ".join(map(str, p)) for p in PROMPTS], sampling_params=greedy)
    context, controller = dynamic_setup(
        model, max_requests=4, max_tokens=6
    )  # prompts longer than the budget are chunked
    greedy.return_log_probs = True
    greedy.skip_prompt_log_probs = True
    dynamic_out = DynamicInferenceEngine(controller, context).generate(PROMPTS, greedy)
    return {
        "expected": expected,
        "static": [r.generated_tokens for r in static_out],
        "dynamic": [r.generated_tokens for r in dynamic_out],
        "expected_log_probs": expected_log_probs,
        "log_probs": [r.generated_log_probs for r in dynamic_out],
        "free_blocks": context.block_allocator.total_avail == context.block_allocator.total_count,
    }


CASES = [(variant, tp, pp) for variant in ("gpt2", "llama") for tp, pp in ((1, 1), (2, 1), (1, 2))]
CASES.append(("mixtral", 2, 1))  # MoE at TP2, without sequence parallelism


@pytest.mark.parametrize("variant,tp,pp", CASES)
def test_kv_cache_greedy_equals_full_forward_greedy(variant, tp, pp):
    for rank, result in enumerate(run_distributed(tp * pp, _generate_both_ways, variant, tp, pp)):
        assert result["static"] == result["expected"], f"rank {rank}: static engine"
        assert result["dynamic"] == result["expected"], f"rank {rank}: dynamic engine"
        assert result["free_blocks"], f"rank {rank}: KV-cache blocks still allocated after generate"
        for actual, expected in zip(result["log_probs"], result["expected_log_probs"]):
            assert actual == pytest.approx(expected, abs=1e-5), f"rank {rank}: log-probs"
