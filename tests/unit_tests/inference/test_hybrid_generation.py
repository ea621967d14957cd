"""A hybrid (Mamba-2 + grouped-query attention + MLP) model generates through both engines: greedy tokens equal
greedy by full forward passes without a cache, token for token, at TP1, TP2 and PP2; with continuous batching a
request gets the same tokens alone or among others joining at different steps (prompts chunked over steps, so
prefills continue from stored Mamba states); no KV block or Mamba state slot is left allocated."""

import pytest
import torch

from tests.unit_tests.test_utilities import run_distributed

NEW_TOKENS = 6
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [42]]
MAX_SEQ = 16  # the hybrid test model's max_sequence_length


def _tokenizer():
    from megatron.core.tokenizers.null_tokenizer import NullTokenizer
    from tests.unit_tests.models.hybrid.hybrid_test_helpers import VOCAB

    return NullTokenizer(VOCAB - 1)  # ids 0..62 plus EOD 63: the model's 64 rows


@torch.no_grad()
def _greedy_without_cache(model, prompt, num_tokens):
    sequence = list(prompt)
    for _ in range(num_tokens):
        logits = model(torch.tensor([sequence]), torch.arange(len(sequence))[None], None)
        sequence.append(int(logits[0, -1, : _tokenizer().vocab_size].argmax()))
    return sequence[len(prompt) :]


def _dynamic(model, block_size_tokens=4, num_blocks=32, max_requests=4, max_tokens=6):
    from megatron.core.inference.contexts import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers import TextGenerationController

    config = model.config
    context = DynamicInferenceContext(
        params_dtype=config.params_dtype,
        num_layers=config.num_layers,
        kv_channels=config.kv_channels,
        num_attention_heads=config.num_query_groups,
        max_sequence_length=MAX_SEQ,
        block_size_tokens=block_size_tokens,
        num_blocks=num_blocks,
        max_requests=max_requests,
        max_tokens=max_tokens,
    )
    controller = TextGenerationController(GPTInferenceWrapper(model, context), _tokenizer())
    return DynamicInferenceEngine(controller, context), context


def _free(context):
    return (
        context.block_allocator.total_avail == context.block_allocator.total_count and context.mamba_slots_in_use == 0
    )


def _generate_both_ways(tp, pp, pattern):
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers import TextGenerationController
    from tests.unit_tests.models.hybrid.hybrid_test_helpers import build_model

    reference = build_model(pattern=pattern.replace("|", "")).eval()  # single process, no collectives
    expected = [_greedy_without_cache(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]
    model = build_model(tp=tp, pp=pp, pattern=pattern).eval()
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
    static = StaticInferenceEngine(TextGenerationController(GPTInferenceWrapper(model), _tokenizer()), legacy=True)
    static_out = static.generate(prompts=[" ".join(map(str, p)) for p in PROMPTS], sampling_params=greedy)
    engine, context = _dynamic(model)  # max_tokens 6: the 7-token prompt is prefilled in two chunks
    dynamic_out = engine.generate(PROMPTS, greedy)
    return {
        "expected": expected,
        "static": [r.generated_tokens for r in static_out],
        "dynamic": [r.generated_tokens for r in dynamic_out],
        "free": _free(context),
    }


@pytest.mark.parametrize("tp,pp,pattern", [(1, 1, "M*-M-"), (2, 1, "M*-M-"), (1, 2, "M*-|M-")])
def test_hybrid_greedy_with_states_equals_full_forward_greedy(tp, pp, pattern):
    for rank, result in enumerate(run_distributed(tp * pp, _generate_both_ways, tp, pp, pattern)):
        assert result["static"] == result["expected"], f"rank {rank}: static engine"
        assert result["dynamic"] == result["expected"], f"rank {rank}: dynamic engine"
        assert result["free"], f"rank {rank}: KV blocks or Mamba state slots still allocated after generate"


def _alone_and_together():
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.models.hybrid.hybrid_test_helpers import build_model

    model = build_model().eval()
    generator = torch.Generator().manual_seed(0)
    requests = []
    for i in range(6):
        prompt = torch.randint(0, 63, (1 + (4 * i) % 9,), generator=generator).tolist()
        if i % 2 == 0:
            params = SamplingParams(top_k=1, num_tokens_to_generate=3 + i % 4, termination_id=-1)
        else:
            params = SamplingParams(
                temperature=0.9, top_k=10, num_tokens_to_generate=5, seed=100 + i, termination_id=-1
            )
        requests.append((prompt, params))
    alone = []
    for i, (prompt, params) in enumerate(requests):
        engine, _ = _dynamic(model)
        engine.add_request(i, prompt, params)
        while engine.has_unfinished_requests():
            engine.step_modern()
        alone.append(engine.get_request(i).generated_tokens)
    # Few slots and a small step budget: requests join at steps 0, 1, 2, ..., wait for a slot, share steps of
    # decodes and prompt chunks, and leave at different steps (their slots are reused by later requests).
    engine, context = _dynamic(model, num_blocks=12, max_requests=3, max_tokens=5)
    pending = list(enumerate(requests))
    mixed = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            i, (prompt, params) = pending.pop(0)
            engine.add_request(i, prompt, params)
        mixed += len(engine.active) > 1
        engine.step_modern()
    together = [engine.get_request(i).generated_tokens for i in range(len(requests))]
    return alone, together, mixed, _free(context)


def test_hybrid_request_gets_the_same_tokens_alone_or_among_others():
    alone, together, mixed, free = run_distributed(1, _alone_and_together)[0]
    assert mixed > 3, "the requests should have shared steps"
    for i, (a, t) in enumerate(zip(alone, together)):
        assert a == t, f"request {i}: alone {a}, among others {t}"
    assert free, "KV blocks or Mamba state slots still allocated after every request finished"


def test_mamba_states_need_registered_layers():
    from megatron.core.inference.contexts import StaticInferenceContext

    with pytest.raises(ValueError, match="no Mamba layers were registered"):
        StaticInferenceContext(1, 4).mamba_states_cache(1)


def _megatron_llm():
    from megatron.core.inference.apis.llm import MegatronLLM
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.models.hybrid.hybrid_test_helpers import build_model

    model = build_model().eval()
    expected = [_greedy_without_cache(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    config = InferenceConfig(max_sequence_length=MAX_SEQ, block_size_tokens=4, max_requests=2)  # two wait
    llm = MegatronLLM(model=model, tokenizer=_tokenizer(), inference_config=config)
    llm.controller.dummy_forward()  # the server's warm-up: a one-token static-context forward touches no request
    out = llm.generate(PROMPTS, SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1))
    return expected, [r.generated_tokens for r in out], _free(llm.context)


def test_megatron_llm_over_a_hybrid_model():
    expected, generated, free = run_distributed(1, _megatron_llm)[0]
    assert generated == expected
    assert free, "KV blocks or Mamba state slots still allocated after generate"


def test_dynamic_context_needs_a_prepared_step_for_mamba_layers():
    from megatron.core.inference.contexts import DynamicInferenceContext

    context = DynamicInferenceContext(
        params_dtype=torch.float32,
        num_layers=1,
        kv_channels=8,
        num_attention_heads=2,
        max_sequence_length=8,
        block_size_tokens=4,
        num_blocks=4,
        device="cpu",
    )
    with pytest.raises(ValueError, match="call prepare_step"):
        context.is_decode_only()
