"""The pieces one by one: sampling parameters and filters, the block allocator, context sizing, request
serialization, the static engine's extras, MegatronLLM, bf16, and every validation error's message."""

import asyncio

import numpy
import pytest
import torch

from megatron.core.inference.contexts import DynamicInferenceContext, KVBlockAllocator
from megatron.core.inference.inference_request import (
    DynamicInferenceEventType,
    DynamicInferenceRequest,
    deserialize_ndarray,
    serialize_ndarray,
)
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.sampling import filtered_probabilities, sample
from tests.unit_tests.test_utilities import run_distributed


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("temperature", -0.5, "temperature must be >= 0"),
        ("top_k", -1, "top_k must be >= 0"),
        ("top_p", 1.5, "top_p must be in [0, 1]"),
        ("num_tokens_to_generate", -2, "num_tokens_to_generate must be >= 0"),
        ("num_tokens_total", 0, "num_tokens_total must be >= 1"),
        ("top_n_logprobs", -1, "top_n_logprobs must be >= 0"),
        ("stop_words", "END", "stop_words must be a list of non-empty strings"),
    ],
)
def test_sampling_params_refuse_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="has no field 'temprature'"):
        SamplingParams().add_attributes({"temprature": 1.0})


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(temperature=2.0)]
    probs = filtered_probabilities(logits, params)
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    full = torch.softmax(logits[1], dim=-1)  # 0.64, 0.24, 0.09, ...: 0.64 < 0.8 <= 0.88 keeps two tokens
    assert (probs[1] > 0).tolist() == [True, True, False, False, False]
    assert probs[1][:2] == pytest.approx((full[:2] / full[:2].sum()).tolist())
    assert probs[2] == pytest.approx(torch.softmax(logits[2] / 2.0, dim=-1).tolist())
    draws = sample(logits[:1].repeat(200, 1), [params[0]] * 200, [None] * 200, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 1}
    greedy = sample(logits[:1], [SamplingParams(top_k=1)], [None], None)
    assert greedy.tolist() == [0]
    assert sample(logits[:1], [SamplingParams(top_k=1)], [None], None, vocab_size=5).tolist() == [0]


def test_block_allocator_hands_out_and_takes_back_blocks():
    allocator = KVBlockAllocator(4)
    first = allocator.allocate_memory_blocks(3)
    assert first == [0, 1, 2] and allocator.total_avail == 1
    with pytest.raises(ValueError, match="2 blocks asked for, 1 free"):
        allocator.allocate_memory_blocks(2)
    allocator.release_memory_blocks(first)
    with pytest.raises(ValueError, match="block 1 released but it is not in use"):
        allocator.release_memory_blocks([1])
    assert allocator.total_avail == 4
    with pytest.raises(ValueError, match="at least one block"):
        KVBlockAllocator(0)


def _context(**overrides):
    kwargs = dict(
        params_dtype=torch.float32,
        num_layers=2,
        kv_channels=8,
        num_attention_heads=4,
        max_sequence_length=32,
        block_size_tokens=4,
        num_blocks=16,
        tensor_model_parallel_size=1,
    )
    kwargs.update(overrides)
    return DynamicInferenceContext(**kwargs)


def test_dynamic_context_sizes_and_its_errors():
    context = _context(num_blocks=None, buffer_size_gb=2 * 2 * 4 * 8 * 4 * 4 * 10 / 1024**3)
    assert context.block_allocator.total_count == 10, "buffer_size_gb / bytes per block"
    assert context.kv_cache_bytes_for_tokens(3) == 2 * 2 * 4 * 8 * 4 * 3
    with pytest.raises(ValueError, match="needs buffer_size_gb or num_blocks"):
        _context(num_blocks=None)
    with pytest.raises(ValueError, match="holds no block of 4 tokens"):
        _context(num_blocks=None, buffer_size_gb=1e-9)
    with pytest.raises(ValueError, match="max_tokens >= max_requests"):
        _context(max_requests=8, max_tokens=4)
    with pytest.raises(ValueError, match="not divisible by tensor_model_parallel_size 3"):
        _context(tensor_model_parallel_size=3)
    with pytest.raises(ValueError, match="block_size_tokens must be >= 1"):
        _context(block_size_tokens=0)
    context = _context()
    context.add_request("a", 9)
    with pytest.raises(ValueError, match="request a is already active"):
        context.add_request("a", 4)
    assert context.block_allocator.total_avail == 13
    with pytest.raises(ValueError, match="call prepare_step"):
        context.cached_attention(None, torch.zeros(1, 1, 4, 8), None, None, None)
    context.release_request("a")
    assert context.block_allocator.total_avail == 16


def test_requests_serialize_without_pickle():
    request = DynamicInferenceRequest(
        request_id=3, prompt="1 2", prompt_tokens=[1, 2], sampling_params=SamplingParams(top_k=1)
    )
    request.add_event(DynamicInferenceEventType.ADD_ENGINE)
    data = request.serialize()
    assert data["status"] == "WAITING_IN_QUEUE" and data["events"][0]["type"] == "ADD_ENGINE"
    assert data["sampling_params"]["top_k"] == 1
    array = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    assert (deserialize_ndarray(serialize_ndarray(array)) == array).all()
    with pytest.raises(ValueError, match="needs prompt_tokens"):
        DynamicInferenceRequest(request_id=4, prompt="x")


def _static_engine_extras():
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers import TextGenerationController
    from tests.unit_tests.inference.inference_test_helpers import (
        MAX_SEQ,
        build_model,
        full_forward_log_probs,
        tokenizer,
    )

    model = build_model("llama")
    engine = StaticInferenceEngine(
        TextGenerationController(GPTInferenceWrapper(model), tokenizer()), max_batch_size=2, legacy=True
    )
    params = SamplingParams(top_k=1, num_tokens_to_generate=4, termination_id=-1, return_log_probs=True)
    prompts = ["3 4 5 6", "9 9", "1"]  # three requests: two batches of at most two
    requests = engine.generate(prompts=prompts, sampling_params=params)
    log_prob_errors = []
    for prompt, request in zip(prompts, requests):
        tokens = [int(t) for t in prompt.split()]
        expected = full_forward_log_probs(model, tokens + request.generated_tokens)
        actual = torch.tensor(request.prompt_log_probs + request.generated_log_probs)
        log_prob_errors.append(float((actual - expected).abs().max()))

    async def stream():
        request_id = engine.add_request(
            "7 8", sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=3), streaming=True
        )
        generator = engine.get_stream_generator(request_id)
        runner = asyncio.ensure_future(engine.run_engine_async())
        seen = [len(r.generated_tokens) async for r in generator]
        await runner
        return seen

    seen = asyncio.run(stream())
    errors = []
    for bad in (
        lambda: engine.generate(prompts=[" ".join(["1"] * (MAX_SEQ + 1))], sampling_params=params),
        lambda: engine.add_request(None),
        lambda: engine.add_request("1", encoder_prompt="x"),
    ):
        try:
            bad()
        except ValueError as error:
            errors.append(str(error))
    return log_prob_errors, seen, errors


def test_static_engine_log_probs_streaming_and_errors():
    log_prob_errors, seen, errors = run_distributed(1, _static_engine_extras)[0]
    assert max(log_prob_errors) < 1e-5
    assert seen[:-1] == [1, 2, 3] and seen[-1] == 3, "one update per token, then the finished request"
    assert "more than the model's max_sequence_length=32" in errors[0]
    assert "needs a prompt or an inference_request" in errors[1]
    assert "encoder-decoder" in errors[2]


def _llm_bf16_and_engine_errors():
    from megatron.core.inference.apis.llm import MegatronLLM
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.engines.dynamic_engine import EngineSuspendedError
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from tests.unit_tests.inference.inference_test_helpers import (
        MAX_SEQ,
        build_model,
        dynamic_setup,
        greedy_without_cache,
        tokenizer,
    )

    out = {}
    model = build_model("gpt2")
    llm = MegatronLLM(
        model=model, tokenizer=tokenizer(), inference_config=InferenceConfig(block_size_tokens=8, max_requests=2)
    )
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=5, termination_id=-1)
    requests = llm.generate(["1 2 3", "4 5"], greedy)
    out["llm"] = [r.generated_tokens for r in requests]
    out["expected"] = [greedy_without_cache(model, p, 5) for p in ([1, 2, 3], [4, 5])]
    out["text"] = requests[0].generated_text
    out["single"] = llm.generate("1 2 3", greedy)[0].generated_tokens

    # bf16: the cache holds bf16 and costs exactly the formula's bytes for the tokens it was sized for.
    bf16 = build_model("llama")
    bf16 = bf16.to(torch.bfloat16)
    bf16.config.params_dtype = torch.bfloat16
    context, controller = dynamic_setup(bf16, block_size_tokens=4, num_blocks=4)
    engine = DynamicInferenceEngine(controller, context)
    out["bf16_tokens"] = engine.generate([[1, 2, 3]], greedy)[0].generated_tokens
    cache_k = next(iter(context.memory_buffer.values()))[0]
    out["bf16_dtype"] = str(cache_k.dtype)
    config = bf16.config
    out["bf16_bytes"] = (
        context.kv_cache_bytes(),
        2 * config.num_layers * config.num_query_groups * config.kv_channels * 16 * 2,
    )

    errors = []
    context, controller = dynamic_setup(model)
    engine = DynamicInferenceEngine(controller, context)
    engine.add_request(1, [1, 2], greedy)
    for bad in (
        lambda: engine.add_request(1, [3], greedy),
        lambda: engine.add_request(2, [1, 500], greedy),
        lambda: engine.add_request(3, 3.5, greedy),
        lambda: engine.add_request(4, [1, 2], SamplingParams(num_tokens_total=1)),
        lambda: engine.pop_request(1),
        lambda: DynamicInferenceEngine(controller, None),
        lambda: DynamicInferenceEngine(
            controller,
            dynamic_setup(model)[0].__class__(
                torch.float32,
                2,
                8,
                8,
                2 * MAX_SEQ,
                block_size_tokens=4,
                num_blocks=64,
                tensor_model_parallel_size=1,
                max_requests=4,
                max_tokens=8,
            ),
        ),
    ):
        try:
            bad()
        except ValueError as error:
            errors.append(str(error))
    engine.suspend()
    try:
        engine.add_request(5, [1], greedy)
    except EngineSuspendedError as error:
        errors.append(str(error))
    try:
        sp_model = build_model("gpt2")
        sp_model.config.sequence_parallel = True
        GPTInferenceWrapper(sp_model)
    except ValueError as error:
        errors.append(str(error))
    engine.resume()
    while engine.has_unfinished_requests():
        engine.step_modern()
    out["errors"] = errors
    out["suspend_ok"] = engine.pop_request(1).generated_length == 5
    return out


def test_megatron_llm_bf16_and_engine_errors():
    out = run_distributed(1, _llm_bf16_and_engine_errors)[0]
    assert out["llm"] == out["expected"]
    assert out["text"] == " ".join(map(str, out["expected"][0]))
    assert out["single"] == out["expected"][0]
    assert len(out["bf16_tokens"]) == 5 and out["bf16_dtype"] == "torch.bfloat16"
    assert out["bf16_bytes"][0] == out["bf16_bytes"][1]
    errors = out["errors"]
    assert "request id 1 is already in use" in errors[0]
    assert "prompt token ids must be in [0, 128)" in errors[1]
    assert "must be a string or token ids" in errors[2]
    assert "num_tokens_total is smaller than the prompt" in errors[3]
    assert "request 1 has not finished" in errors[4]
    assert "needs a DynamicInferenceContext, got NoneType" in errors[5]
    assert "exceeds the model's learned position table (32 positions)" in errors[6]
    assert "suspended" in errors[7]
    assert "build the model with sequence_parallel=False" in errors[8]
    assert out["suspend_ok"]


def _half_precision(dtype_name):
    from megatron.core.inference.engines import DynamicInferenceEngine
    from tests.unit_tests.inference.inference_test_helpers import build_model, dynamic_setup, greedy_without_cache

    dtype = getattr(torch, dtype_name)
    model = build_model("gpt2").to(dtype)
    model.config.params_dtype = dtype
    context, controller = dynamic_setup(model)
    params = SamplingParams(top_k=1, num_tokens_to_generate=6, termination_id=-1)
    tokens = DynamicInferenceEngine(controller, context).generate([[3, 1, 4, 1, 5]], params)[0].generated_tokens
    cache_dtype = next(iter(context.memory_buffer.values()))[0].dtype
    return tokens, greedy_without_cache(model, [3, 1, 4, 1, 5], 6), str(cache_dtype)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_half_precision_generation_keeps_its_cache_in_that_dtype(dtype_name):
    tokens, expected, cache_dtype = run_distributed(1, _half_precision, dtype_name)[0]
    assert cache_dtype == f"torch.{dtype_name}"
    assert tokens == expected


def _weight_layout(directory):
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
        column_major_linear_weights_on_cpu,
    )
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from tests.unit_tests.inference.inference_test_helpers import build_model

    out = {}
    for variant in ("llama", "gpt2"):  # llama ties the output layer to the word embedding, gpt2 does not
        model = build_model(variant)
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        positions = torch.arange(ids.shape[1])[None]
        with torch.no_grad():
            before_logits = model(ids, positions, None)
        before_state = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        linears = [
            m.weight
            for m in model.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None
        ]
        GPTInferenceWrapper(model)
        embedding = model.embedding.word_embeddings.weight
        with torch.no_grad():
            after_logits = model(ids, positions, None)
        after_state = model.state_dict()
        out[variant] = {
            "linears_column_major": all(w.stride() == (1, w.shape[0]) for w in linears),
            "embedding_column_major": embedding.stride() == (1, embedding.shape[0]),
            "logits_error": (after_logits - before_logits).abs().max().item(),
            "same_state": before_state.keys() == {k for k, v in after_state.items() if isinstance(v, torch.Tensor)}
            and all(torch.equal(before_state[k], after_state[k]) for k in before_state),
            "again": column_major_linear_weights_on_cpu(model),
        }
        # A checkpoint saved from the re-laid-out model loads into a fresh one exactly.
        dist_checkpointing.save({"model": model.sharded_state_dict()}, f"{directory}/{variant}")
        fresh = build_model(variant, seed=99)
        fresh.load_state_dict(
            dist_checkpointing.load({"model": fresh.sharded_state_dict()}, f"{directory}/{variant}")["model"]
        )
        out[variant]["checkpoint_exact"] = all(
            torch.equal(before_state[k], v) for k, v in fresh.state_dict().items() if k in before_state
        )
    plain = build_model("gpt2")
    ddp = DistributedDataParallel(plain.config, DistributedDataParallelConfig(), plain)
    out["ddp_changed"] = column_major_linear_weights_on_cpu(ddp)
    out["ddp_contiguous"] = all(p.is_contiguous() for p in ddp.parameters())
    return out


def test_cpu_inference_stores_linear_weights_column_major_without_changing_values(tmp_path):
    for variant in ("llama", "gpt2"):
        (tmp_path / variant).mkdir()
    out = run_distributed(1, _weight_layout, str(tmp_path))[0]
    for variant in ("llama", "gpt2"):
        assert out[variant]["linears_column_major"], variant
        assert out[variant]["logits_error"] < 1e-5, variant
        assert out[variant]["same_state"], variant
        assert out[variant]["again"] == 0, variant  # already column-major: nothing to do
        assert out[variant]["checkpoint_exact"], variant
    assert out["llama"]["embedding_column_major"]  # the tied output layer's weight
    assert not out["gpt2"]["embedding_column_major"]  # only looked up: row-major stays faster
    assert out["ddp_changed"] == 0 and out["ddp_contiguous"]  # DDP's parameters are views of its buffers
