"""Every ``--attention-backend`` equals the unfused reference on a tiny GPT on CPU (loss, logits, gradients), at
CP2 and in inference (static and dynamic engines), and a backend that cannot serve the config says so.

One worker per world size runs all cases of that size; the tests read its results.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnBackend
from tests.unit_tests.models.gpt_test_helpers import (
    BATCH,
    SEQ,
    assert_close_dicts,
    batch,
    build_model,
    relative_error,
)
from tests.unit_tests.test_utilities import run_distributed

TOLERANCE = 1e-5
ALL = ("unfused", "local", "fused", "flash", "auto")
# local runs unfused's code, checked once (gpt2); flash needs the Triton kernel (CUDA) for windows, which
# tests/unit_tests/fusions/test_flash_attention_triton.py checks under the interpreter.
SDPA_ONES = ("unfused", "fused", "flash", "auto")
WINDOWED = ("unfused", "fused", "auto")


def _padding_mask() -> torch.Tensor:
    """Causal, plus the last three keys of the second sequence hidden (True = masked)."""
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH, 1, SEQ, SEQ).clone()
    mask[1, ..., -3:] = True
    return mask


CASES = {
    # multi-head attention, a softmax scale of its own, head size apart from hidden / heads
    "gpt2": ("gpt2", {"softmax_scale": 0.3, "kv_channels": 12}, False, ALL),
    # grouped-query attention with a padding mask from the caller
    "llama-padding": ("llama", {}, True, SDPA_ONES),
    # sliding window on every other layer, grouped-query attention
    "llama-window": ("llama", {"window_size": (5, 0), "window_attn_skip_freq": 2}, False, WINDOWED),
}


def _step(variant, overrides, padded, backend):
    model = build_model(1, False, variant, config_overrides={**overrides, "attention_backend": AttnBackend[backend]})
    tokens, position_ids, labels = batch()
    mask = _padding_mask() if padded else None
    logits = model(tokens, position_ids, mask)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    return loss.item(), logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _errors():
    from megatron.core.transformer import attention_backends
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from tests.unit_tests.models.gpt_test_helpers import build_config

    def message(config, patch_supported=None):
        original = attention_backends.flash_attention_supported
        if patch_supported is not None:  # the rule for a device that runs the kernel, without one at hand
            attention_backends.flash_attention_supported = lambda device: patch_supported
        try:
            DotProductAttention(config, 1, AttnMaskType.causal, "self")
        except ValueError as error:
            return str(error)
        finally:
            attention_backends.flash_attention_supported = original
        return None

    flash_window = {"attention_backend": AttnBackend.flash, "window_size": (4, 0)}
    return {
        "no_device": message(build_config(1, False, flash_window), patch_supported=False),
        "dropout": message(build_config(1, False, {**flash_window, "attention_dropout": 0.1}), patch_supported=True),
        "flash_full_attention": message(build_config(1, False, {"attention_backend": AttnBackend.flash})),
    }


def _window_chunks():
    """Windowed SDPA runs one query chunk at a time (64 queries here): fused vs unfused over several chunks, for
    training (forward and backward) and for 5 queries continuing 150 cached keys. Max abs errors."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from tests.unit_tests.models.gpt_test_helpers import build_config

    gen = torch.Generator().manual_seed(0)
    errors = []
    for window, sq, sk, mask_type in (
        ((20, 0), 200, 200, AttnMaskType.causal),
        ((40, 0), 5, 150, AttnMaskType.causal_bottom_right),
    ):
        q = torch.randn(sq, 2, 8, 8, generator=gen)
        k, v = torch.randn(sk, 2, 4, 8, generator=gen), torch.randn(sk, 2, 4, 8, generator=gen)
        results = []
        for backend in (AttnBackend.fused, AttnBackend.unfused):
            config = build_config(
                1, False, {"num_query_groups": 4, "window_size": window, "attention_backend": backend}
            )
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = DotProductAttention(config, 1, AttnMaskType.causal, "self")(*inputs, None, attn_mask_type=mask_type)
            results.append([out, *torch.autograd.grad(out.sum(), inputs)])
        errors += [(a - b).abs().max().item() for a, b in zip(*results)]
    return errors


def _single_rank():
    results = {}
    for case, (variant, overrides, padded, backends) in CASES.items():
        for backend in backends:
            results[case, backend] = _step(variant, overrides, padded, backend)
    results["errors"] = _errors()  # after build_model has initialised the model-parallel groups
    results["window_chunks"] = _window_chunks()
    return results


@pytest.fixture(scope="module")
def single_rank():
    return run_distributed(1, _single_rank)[0]


@pytest.mark.parametrize("case,backend", [(c, b) for c, spec in CASES.items() for b in spec[3] if b != "unfused"])
def test_backend_equals_unfused(single_rank, case, backend):
    loss, logits, grads = single_rank[case, backend]
    ref_loss, ref_logits, ref_grads = single_rank[case, "unfused"]
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), f"{case} {backend}: loss {loss} vs {ref_loss}"
    assert relative_error(logits, ref_logits) <= TOLERANCE, f"{case} {backend}: logits"
    assert_close_dicts(grads, ref_grads, TOLERANCE, f"{case} {backend}")


def test_window_changes_the_result(single_rank):
    """The windowed case is not accidentally full attention (else the window tests prove nothing)."""
    windowed = single_rank["llama-window", "unfused"][0]
    full = single_rank["llama-padding", "unfused"][0]
    assert windowed != full


def test_windowed_sdpa_in_query_chunks_equals_unfused(single_rank):
    assert max(single_rank["window_chunks"]) <= 1e-5


def test_flash_without_a_device_for_windows_is_refused(single_rank):
    text = single_rank["errors"]["no_device"]
    assert text is not None and "--attention-backend flash" in text and "--window-size 4,0" in text
    assert "needs a CUDA device and triton" in text and "use --attention-backend auto, fused or unfused" in text


def test_flash_window_with_dropout_is_refused(single_rank):
    text = single_rank["errors"]["dropout"]
    assert text is not None and "no attention dropout (--attention-dropout 0.1)" in text
    assert "set --attention-dropout 0 or use --attention-backend auto, fused or unfused" in text


def test_flash_without_window_builds(single_rank):
    assert single_rank["errors"]["flash_full_attention"] is None


# ---- context parallelism --------------------------------------------------------------------------------------------

CP_RUNS = [
    ("unfused", "p2p"),
    ("unfused", "all_gather"),
    ("unfused", "a2a"),
    ("fused", "all_gather"),
    ("fused", "a2a"),
    ("auto", "p2p"),
    ("local", "all_gather"),
]


def _context_parallel():
    from tests.unit_tests.transformer.context_parallel.test_gpt_context_parallel import _loss_and_grads

    unfused = {"attention_backend": AttnBackend.unfused}
    expected_loss, expected_grads = _loss_and_grads(1, False, 1, "llama", extra=unfused)
    results = {}
    for backend, comm_type in CP_RUNS:
        loss, grads = _loss_and_grads(
            1, False, 2, "llama", comm_type, None, {"attention_backend": AttnBackend[backend]}
        )
        errors = [relative_error(grads[name], expected_grads[name]) for name in expected_grads]
        results[backend, comm_type] = (abs(loss - expected_loss).item() / abs(expected_loss).item(), max(errors))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def context_parallel():
    return run_distributed(2, _context_parallel)


@pytest.mark.parametrize("backend,comm_type", CP_RUNS)
def test_context_parallel_backend_equals_unfused_single_process(context_parallel, backend, comm_type):
    for rank, results in enumerate(context_parallel):
        loss_error, grad_error = results[backend, comm_type]
        assert loss_error <= TOLERANCE and grad_error <= TOLERANCE, f"rank {rank} {backend} {comm_type}"


# ---- inference -------------------------------------------------------------------------------------------------------

NEW_TOKENS = 4


def _inference():
    from megatron.core.inference.engines import DynamicInferenceEngine, StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers import TextGenerationController
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from tests.unit_tests.inference.inference_test_helpers import MAX_SEQ, MODELS, PROMPTS, dynamic_setup, tokenizer
    from tests.unit_tests.models.gpt_test_helpers import VOCAB, build_config

    results = {}
    for backend in ALL:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1)
        model_parallel_cuda_manual_seed(1234)
        spec = MODELS["llama"]
        config = build_config(1, False, {**spec["config"], "attention_backend": AttnBackend[backend]})
        model = GPTModel(
            config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=MAX_SEQ, **spec["model"]
        )
        model.eval()
        greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
        static = StaticInferenceEngine(TextGenerationController(GPTInferenceWrapper(model), tokenizer()), legacy=True)
        static_out = static.generate(prompts=[" ".join(map(str, p)) for p in PROMPTS], sampling_params=greedy)
        context, controller = dynamic_setup(model, max_requests=4, max_tokens=6)
        greedy.return_log_probs = True
        greedy.skip_prompt_log_probs = True
        dynamic_out = DynamicInferenceEngine(controller, context).generate(PROMPTS, greedy)
        results[backend] = (
            [r.generated_tokens for r in static_out],
            [r.generated_tokens for r in dynamic_out],
            torch.tensor([r.generated_log_probs for r in dynamic_out]),
        )
    return results


@pytest.fixture(scope="module")
def inference():
    return run_distributed(1, _inference)[0]


@pytest.mark.parametrize("backend", [b for b in ALL if b != "unfused"])
def test_inference_backend_equals_unfused(inference, backend):
    static, dynamic, log_probs = inference[backend]
    ref_static, ref_dynamic, ref_log_probs = inference["unfused"]
    assert static == ref_static and dynamic == ref_dynamic
    assert torch.allclose(log_probs, ref_log_probs, atol=1e-5, rtol=1e-5)
