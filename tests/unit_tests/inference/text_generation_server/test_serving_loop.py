"""The serving loop's lockstep at TP2 and PP2: rank 0 takes requests (arriving while others run), broadcasts each
turn, every rank steps; every request gets the no-cache greedy tokens, a request cancelled mid-generation leaves
every rank's engine at the same point, and every rank ends with its KV cache free and no requests left."""

import pytest

from tests.unit_tests.test_utilities import run_distributed

NEW_TOKENS = 6


def _serve(tp: int, pp: int):
    import asyncio

    import torch.distributed as dist

    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_server.server import control_group
    from megatron.core.inference.text_generation_server.serving_loop import ServingLoop
    from tests.unit_tests.inference.inference_test_helpers import (
        PROMPTS,
        build_model,
        dynamic_setup,
        greedy_without_cache,
    )

    reference = build_model("llama")
    expected = [greedy_without_cache(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]
    model = build_model("llama", tp, pp)
    context, controller = dynamic_setup(model, max_requests=2, max_tokens=8)
    engine = DynamicInferenceEngine(controller, context)
    loop = ServingLoop(engine, group=control_group(), heartbeat_s=0.05)
    got = None
    if dist.get_rank() == 0:

        async def clients():
            async def one(prompt, delay):
                await asyncio.sleep(delay)  # later requests arrive while earlier ones decode
                handle = loop.submit(
                    prompt, SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
                )
                tokens = []
                async for progress in handle:
                    assert progress.error is None, progress.error
                    tokens += progress.tokens
                return tokens

            async def cancelled():
                handle = loop.submit(
                    PROMPTS[0], SamplingParams(top_k=1, num_tokens_to_generate=4 * NEW_TOKENS, termination_id=-1)
                )
                async for _ in handle:  # its first tokens: it is in the batch, then its client goes away
                    loop.cancel(handle.request_id)
                    break

            *got, _ = await asyncio.gather(*[one(p, 0.03 * i) for i, p in enumerate(PROMPTS)], cancelled())
            return got

        loop.start()
        try:
            got = asyncio.run(clients())
        finally:
            loop.shutdown()
    else:
        loop.follow()
    allocator = context.block_allocator
    return {
        "got": got,
        "expected": expected,
        "cancelled": loop.cancelled,
        "left": len(engine.requests),
        "free": allocator.total_avail == allocator.total_count,
    }


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_every_rank_steps_with_rank_0_and_requests_get_the_reference_tokens(tp, pp):
    results = run_distributed(tp * pp, _serve, tp, pp)
    assert results[0]["got"] == results[0]["expected"]
    assert results[0]["cancelled"] == 1
    for rank, result in enumerate(results):
        assert result["left"] == 0, f"rank {rank}: finished requests still in the engine"
        assert result["free"], f"rank {rank}: KV-cache blocks still allocated"
