"""Continuous batching: a request's tokens do not depend on its neighbours; the KV cache never leaks; requests
that cannot fit are refused clearly; stop conditions; log-probs; seeded sampling; streaming."""

import asyncio

import pytest
import torch

from tests.unit_tests.test_utilities import run_distributed


def _engine(model, **context_kwargs):
    from megatron.core.inference.engines import DynamicInferenceEngine
    from tests.unit_tests.inference.inference_test_helpers import dynamic_setup

    context, controller = dynamic_setup(model, **context_kwargs)
    return DynamicInferenceEngine(controller, context), context


def _requests():
    """Nine requests: greedy and seeded sampling (temperature, top-k, top-p), prompts of 1-11 tokens."""
    from megatron.core.inference.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(9):
        prompt = torch.randint(0, 127, (1 + (5 * i) % 11,), generator=generator).tolist()
        if i % 3 == 0:
            params = SamplingParams(top_k=1, num_tokens_to_generate=4 + i % 4, termination_id=-1)
        else:
            params = SamplingParams(
                temperature=0.8 + 0.1 * i,
                top_k=(0, 20)[i % 2],
                top_p=(0.0, 0.9)[i % 3 == 1],
                num_tokens_to_generate=5,
                seed=100 + i,
                termination_id=-1,
            )
        out.append((prompt, params))
    return out


def _alone_and_together(variant):
    from tests.unit_tests.inference.inference_test_helpers import build_model

    model = build_model(variant)
    alone = []
    for i, (prompt, params) in enumerate(_requests()):
        engine, _ = _engine(model)
        engine.add_request(i, prompt, params)
        while engine.has_unfinished_requests():
            engine.step_modern()
        alone.append(engine.get_request(i).generated_tokens)
    # Together: a small cache and step budget, requests joining at steps 0, 1, 2, ...: prefill chunks share steps
    # with decodes, some requests wait for blocks, and requests leave at different steps.
    engine, context = _engine(model, block_size_tokens=4, num_blocks=12, max_requests=5, max_tokens=7)
    pending = list(enumerate(_requests()))
    steps_with_mixed_batches = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            i, (prompt, params) = pending.pop(0)
            engine.add_request(i, prompt, params)
        plan_sizes = len(engine.active)
        engine.step_modern()
        steps_with_mixed_batches += plan_sizes > 1
    together = [engine.get_request(i).generated_tokens for i in range(len(alone))]
    return (
        alone,
        together,
        context.block_allocator.total_avail,
        context.block_allocator.total_count,
        (steps_with_mixed_batches),
    )


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_each_request_gets_the_same_tokens_alone_or_among_others(variant):
    alone, together, free, total, mixed = run_distributed(1, _alone_and_together, variant)[0]
    assert mixed > 3, "the requests should have shared steps"
    for i, (a, t) in enumerate(zip(alone, together)):
        assert a == t, f"request {i}: alone {a}, among others {t}"
    assert free == total, f"{total - free} KV-cache blocks still allocated after every request finished"


def _too_big():
    from megatron.core.inference.contexts import BlockOverflowError, TokenOverflowError
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.inference.inference_test_helpers import MAX_SEQ, build_model

    engine, context = _engine(build_model("gpt2"), block_size_tokens=4, num_blocks=8)
    messages = []
    try:
        engine.add_request(0, [1] * 10, SamplingParams(num_tokens_to_generate=MAX_SEQ))
    except TokenOverflowError as error:
        messages.append(str(error))
    try:
        engine.add_request(1, [1] * 10, SamplingParams(num_tokens_to_generate=20))  # 30 tokens: 8 blocks of 4 hold 32
        engine.add_request(2, [1] * 20, SamplingParams(num_tokens_to_generate=12))  # 32 tokens: fits exactly
    except BlockOverflowError as error:
        messages.append(f"unexpected: {error}")
    small_engine, _ = _engine(build_model("gpt2"), block_size_tokens=4, num_blocks=8)
    try:
        # A cache of 8 blocks fits one 32-token sequence, so shrink the context's view of it for this case.
        small_engine.context.block_allocator.total_count = 7
        small_engine.add_request(3, [1] * 20, SamplingParams(num_tokens_to_generate=12))
    except BlockOverflowError as error:
        messages.append(str(error))
    try:
        engine.add_request(4, [], SamplingParams(num_tokens_to_generate=1))
    except ValueError as error:
        messages.append(str(error))
    while engine.has_unfinished_requests():
        engine.step_modern()
    finished = [engine.get_request(i).generated_length for i in (1, 2)]
    return messages, finished, context.block_allocator.total_avail


def test_a_request_that_cannot_fit_is_refused_with_a_clear_error():
    messages, finished, free = run_distributed(1, _too_big)[0]
    assert "max_sequence_length=32" in messages[0] and "shorten the prompt" in messages[0]
    assert "needs 8 KV-cache blocks" in messages[1] and "has only 7" in messages[1], messages
    assert "the prompt has no tokens" in messages[2]
    assert finished == [20, 12], "the requests that fit ran (one after the other: each needs the whole cache)"
    assert free == 8


def _stops():
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.inference.inference_test_helpers import build_model, greedy_without_cache

    model = build_model("gpt2")
    prompt = [3, 1, 4, 1, 5]
    free_run = greedy_without_cache(model, prompt, 8)
    engine, context = _engine(model)
    outcomes = {}
    # EOD: the third greedy token is declared the termination id; it is the last token generated.
    outcomes["eod"] = engine.generate(
        [prompt], SamplingParams(top_k=1, num_tokens_to_generate=8, termination_id=free_run[2])
    )[0]
    # A stop string: the text of the fourth token (NullTokenizer text is the ids joined by spaces).
    stop = f" {free_run[3]}"
    outcomes["stop"] = engine.generate(
        [prompt], SamplingParams(top_k=1, num_tokens_to_generate=8, termination_id=-1, stop_words=[stop])
    )[0]
    outcomes["stop_kept"] = engine.generate(
        [prompt],
        SamplingParams(
            top_k=1, num_tokens_to_generate=8, termination_id=-1, stop_words=[stop], detokenize_stop_sequence=True
        ),
    )[0]
    outcomes["length"] = engine.generate(
        [prompt], SamplingParams(top_k=1, num_tokens_to_generate=3, termination_id=-1)
    )[0]
    return (
        free_run,
        {k: (r.generated_tokens, r.generated_text, r.status.name) for k, r in outcomes.items()},
        (context.block_allocator.total_avail == context.block_allocator.total_count),
    )


def test_generation_stops_at_eod_stop_string_or_length():
    free_run, outcomes, no_leak = run_distributed(1, _stops)[0]
    text = lambda tokens: " ".join(map(str, tokens))  # noqa: E731
    assert outcomes["eod"][0] == free_run[:3]
    assert outcomes["eod"][1] == text(free_run[:2]), "the EOD token is not part of the text"
    assert outcomes["stop"][0] == free_run[:4]
    assert outcomes["stop"][1] == text(free_run[:3]), "the stop string is cut from the text"
    assert outcomes["stop_kept"][1] == text(free_run[:4])
    assert outcomes["length"][0] == free_run[:3]
    assert all(status == "COMPLETED" for _, _, status in outcomes.values())
    assert no_leak


def _log_probs(variant):
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.inference.inference_test_helpers import build_model, full_forward_log_probs

    model = build_model(variant)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    engine, _ = _engine(model, max_requests=2, max_tokens=4)  # the 9-token prompt is prefilled in 3 chunks
    request = engine.generate(
        [prompt],
        SamplingParams(top_k=1, num_tokens_to_generate=5, termination_id=-1, return_log_probs=True, top_n_logprobs=3),
    )[0]
    expected = full_forward_log_probs(model, prompt + request.generated_tokens)
    return (
        request.prompt_log_probs,
        request.generated_log_probs,
        expected.tolist(),
        request.generated_top_n_logprobs,
        request.generated_tokens,
    )


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_log_probs_equal_those_of_a_full_forward(variant):
    prompt_lp, generated_lp, expected, top_n, tokens = run_distributed(1, _log_probs, variant)[0]
    assert len(prompt_lp) == 8 and len(generated_lp) == 5
    assert torch.allclose(
        torch.tensor(prompt_lp + generated_lp), torch.tensor(expected[:-1] + expected[-1:]), atol=1e-5
    )
    for token, lp, entry in zip(tokens, generated_lp, top_n):
        assert len(entry) == 3 and max(entry.values()) == pytest.approx(lp, abs=1e-6)
        assert str(token) in entry, "greedy: the chosen token is the most likely one"


def _seeded():
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.inference.inference_test_helpers import build_model

    model = build_model("llama")
    prompt = [5, 6, 7]

    def run(seed):
        engine, _ = _engine(model)
        params = SamplingParams(temperature=1.5, num_tokens_to_generate=12, seed=seed, termination_id=-1)
        return engine.generate([prompt], params)[0].generated_tokens

    return run(7), run(7), run(8)


def test_sampling_with_a_seed_is_reproducible():
    first, again, other_seed = run_distributed(1, _seeded)[0]
    assert first == again
    assert first != other_seed, "a different seed should give a different sample (12 tokens at temperature 1.5)"


def _streaming():
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.inference.inference_test_helpers import build_model

    engine, _ = _engine(build_model("gpt2"))

    async def main():
        runner = asyncio.create_task(engine.run_engine())
        future = engine.add_request(0, [1, 2, 3], SamplingParams(top_k=1, num_tokens_to_generate=4, termination_id=-1))
        seen = [len(r.generated_tokens) async for r in engine.get_stream_generator(0)]
        request = await future
        engine.shutdown()
        await runner
        events = [e.type.name for e in request.events]
        return seen, request.generated_tokens, events, engine.state.name

    return asyncio.run(main())


def test_streaming_yields_every_new_token_and_the_future_resolves():
    seen, tokens, events, state = run_distributed(1, _streaming)[0]
    assert seen == [1, 2, 3, 4] and len(tokens) == 4
    assert events == ["ADD_ENGINE", "ADD_CONTEXT"] + ["GENERATED_TOKEN"] * 4 + ["FINISH"]
    assert state == "STOPPED"


def _equal_lengths():
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.inference.inference_test_helpers import build_model, greedy_without_cache

    model = build_model("llama")
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4], [3, 3, 3, 3, 3, 3]]
    engine, _ = _engine(model, block_size_tokens=4)  # each request's blocks are padded past its length
    params = SamplingParams(top_k=1, num_tokens_to_generate=6, termination_id=-1)
    together = [r.generated_tokens for r in engine.generate(prompts, params)]
    return together, [greedy_without_cache(model, p, 6) for p in prompts]


def test_a_batch_decoding_at_equal_lengths_matches_the_no_cache_reference():
    together, expected = run_distributed(1, _equal_lengths)[0]
    assert together == expected


def _cancel():
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.inference.inference_test_helpers import build_model

    engine, context = _engine(build_model("gpt2"), block_size_tokens=4, num_blocks=6, max_requests=4)
    params = SamplingParams(top_k=1, num_tokens_to_generate=8, termination_id=-1)
    engine.add_request(0, [3, 1, 4], params)  # 11 tokens: 3 blocks
    engine.add_request(1, [1, 5, 9], params)  # 3 more blocks: the cache is full
    engine.add_request(2, [2, 6, 5], params)  # waits for room
    engine.step_modern()
    before = (list(engine.active), list(engine.waiting), context.block_allocator.total_avail)
    cancelled = (engine.cancel_request(0), engine.cancel_request(2))
    after_cancel = (list(engine.active), list(engine.waiting), context.block_allocator.total_avail)
    again = (engine.cancel_request(0), engine.cancel_request(99))  # gone / never was: nothing to do
    while engine.has_unfinished_requests():
        engine.step_modern()
    finished = engine.cancel_request(1)  # finished: left alone
    return before, cancelled, after_cancel, again, finished, sorted(engine.requests), engine.get_request(1).status.name


def test_cancelling_a_request_frees_its_blocks_and_slot_at_once_and_leaves_finished_ones_alone():
    before, cancelled, after_cancel, again, finished, left, status = run_distributed(1, _cancel)[0]
    assert before == ([0, 1], [2], 0)
    assert cancelled == (True, True)
    assert after_cancel == ([1], [], 3), "request 0's three blocks are free and request 2 no longer waits"
    assert again == (False, False) and finished is False
    assert left == [1] and status == "COMPLETED"
