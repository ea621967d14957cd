"""Masked softmax and bias + dropout + add on CPU: the fused functions' PyTorch bodies against the unfused paths
(bitwise, forward and backward), Megatron's module API, the fallback notices, DotProductAttention's explicit path
against the explicit reference it replaced, and a GPT with both fusions on against the same model with them off.
The Triton kernels themselves are checked in test_triton_kernels.py."""

import itertools
import warnings

import pytest
import torch

from megatron.core.fusions import fused_bias_dropout, fused_softmax, kernel_dispatch
from megatron.core.fusions.fused_softmax import (
    FusedScaleMaskSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func
from tests.unit_tests.test_utilities import run_distributed


def _softmax(fusion: bool, mask_type=AttnMaskType.padding, scale=None, bf16=False, window_size=None):
    return FusedScaleMaskSoftmax(False, bf16, mask_type, fusion, attention_mask_func, True, scale, window_size)


def _forward_backward(module, scores, mask):
    scores = scores.clone().requires_grad_()
    probs = module(scores * 1.0, mask)  # attention_mask_func fills in place: never the leaf itself
    grad = torch.linspace(-1, 1, probs.numel()).view(probs.shape).to(probs.dtype)
    probs.backward(grad)
    return probs, scores.grad


def _forbidden(*args, **kwargs):
    raise AssertionError("the unfused softmax ran instead of the fused math")


def _cases():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 6, 6, generator=g) * 4
    mask = torch.rand(2, 1, 6, 6, generator=g) < 0.4
    mask[0, 0, 1] = True  # one query sees no key: its probabilities are zeros
    yield "causal", AttnMaskType.causal, scores, None
    yield "mask", AttnMaskType.padding, scores, mask
    yield "padding mask [b, 1, 1, sk]", AttnMaskType.padding, scores, mask[:, :, :1]
    yield "no mask", AttnMaskType.no_mask, scores, None


@pytest.mark.parametrize("body", ("eager", "compiled math"))
@pytest.mark.parametrize("bf16", (False, True), ids=("fp32", "bf16"))
@pytest.mark.parametrize("scale", (None, 0.5))
@pytest.mark.parametrize("case", [c[0] for c in _cases()])
def test_fused_softmax_on_cpu_equals_unfused_bitwise(monkeypatch, case, scale, bf16, body):
    if body == "compiled math":  # the body MEGATRON_LITE_COMPILE_FUSIONS=1 compiles, run eagerly
        monkeypatch.setattr(fused_softmax, "compile_cpu_fusions", lambda: True)
        monkeypatch.setattr(fused_softmax, "cpu_body", lambda fn: fn)
        monkeypatch.setattr(FusedScaleMaskSoftmax, "forward_torch_softmax", _forbidden, raising=True)
    _, mask_type, scores, mask = next(c for c in _cases() if c[0] == case)
    scores = scores.bfloat16() if bf16 else scores
    fused, unfused = _softmax(True, mask_type, scale, bf16), _softmax(False, mask_type, scale, bf16)
    assert fused.is_kernel_available(mask, *scores.shape) and not unfused.is_kernel_available(mask, *scores.shape)
    probs, grad = _forward_backward(fused, scores, mask)
    monkeypatch.undo()
    ref_probs, ref_grad = _forward_backward(unfused, scores, mask)
    assert probs.dtype == scores.dtype
    assert torch.equal(probs, ref_probs) and torch.equal(grad, ref_grad)
    if mask is not None:
        hidden = mask.expand_as(probs)
        assert torch.all(probs[hidden] == 0)
        assert case != "mask" or torch.all(probs[0, :, 1] == 0)  # a fully masked row
    visible_rows = probs.float().sum(-1)
    assert torch.allclose(visible_rows[visible_rows > 0], torch.ones(()), atol=1e-2 if bf16 else 1e-6)


def test_causal_softmax_of_equal_scores_is_uniform_over_the_past():
    probs = _softmax(True, AttnMaskType.causal)(torch.zeros(2, 2, 8, 8), None)
    expected = torch.ones(8, 8).tril() / torch.arange(1, 9).view(-1, 1)
    torch.testing.assert_close(probs, expected.expand_as(probs), rtol=0, atol=1e-7)


def test_megatron_autograd_functions_on_cpu_tensors():
    """The functions Megatron's module calls (the kernel's shape, with a hand-written backward from the saved
    probabilities) compute the same as autograd over PyTorch's softmax when handed CPU tensors."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 5, generator=g)
    mask = torch.rand(2, 1, 5, 5, generator=g) < 0.3
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    cases = (
        (lambda t: ScaledUpperTriangMaskedSoftmax.apply(t.view(-1, 5, 5), 0.5).view(2, 3, 5, 5), causal),
        (lambda t: ScaledMaskedSoftmax.apply(t, mask, 0.5), mask),
        (lambda t: ScaledSoftmax.apply(t, 0.5), torch.zeros(5, dtype=torch.bool)),
    )
    for fn, hidden in cases:
        ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = fn(ours), torch.softmax((ref * 0.5).masked_fill(hidden, float("-inf")), -1)
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_kernel_availability_and_its_limits():
    causal = _softmax(True, AttnMaskType.causal)
    assert causal.is_kernel_available(None, 2, 4, 32, 32)
    assert not causal.is_kernel_available(None, 2, 4, 16, 32)  # a generated causal mask needs sq == sk
    assert causal.is_kernel_available(torch.zeros(16, 32, dtype=torch.bool), 2, 4, 16, 32)  # a mask given
    assert not causal.is_kernel_available(None, 1, 1, 20000, 20000)  # wider than one program's row
    assert not _softmax(False, AttnMaskType.causal).is_kernel_available(None, 2, 4, 32, 32)
    assert FusedScaleMaskSoftmax.get_batch_per_block(32, 32, 2, 4) == 1
    with pytest.raises(ValueError, match=r"a generated causal mask needs sq == sk \(self-attention\), got sq=4, sk=16"):
        causal(torch.zeros(1, 1, 4, 16), None)
    with pytest.raises(ValueError, match=r"FusedScaleMaskSoftmax takes scores \[b, np, sq, sk\], got shape \(4, 4\)"):
        causal(torch.zeros(4, 4), None)
    with pytest.raises(ValueError, match="input_in_fp16 and input_in_bf16 cannot both be set"):
        FusedScaleMaskSoftmax(True, True, AttnMaskType.causal, True, attention_mask_func, True, None)
    with pytest.raises(ValueError, match="a scale needs softmax_in_fp32=True"):
        FusedScaleMaskSoftmax(False, True, AttnMaskType.causal, True, attention_mask_func, False, 0.5)


def test_window_and_softmax_offset():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 6, 6, generator=g)
    window = (2, 0)
    hidden = ~torch.ones(6, 6, dtype=torch.bool).tril().triu(-2)
    expected = torch.softmax(x.masked_fill(hidden, float("-inf")), -1)
    for fusion in (True, False):
        torch.testing.assert_close(_softmax(fusion, window_size=window)(x.clone(), None), expected)
    offset = torch.tensor([0.0, 1.5])
    sink = offset.view(1, 2, 1, 1).expand(1, 2, 6, 1)
    expected = torch.softmax(torch.cat([x.masked_fill(hidden, -10000.0), sink], -1), -1)[..., :-1]
    out = _softmax(True, window_size=window)(x.clone(), None, offset)  # offsets run the PyTorch path
    torch.testing.assert_close(out, expected)


# ---- bias + dropout + add -------------------------------------------------------------------------------------------


def _bda_inputs(x_dtype=torch.float32, residual_dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 16, generator=g).to(x_dtype).requires_grad_()
    bias = torch.randn(16, generator=g).to(x_dtype).requires_grad_()
    return x, bias, torch.randn(5, 2, 16, generator=g).to(residual_dtype).requires_grad_()


def _bda_run(fn, inputs, prob, seed=5):
    x, bias, residual = (t.detach().clone().requires_grad_() for t in inputs)
    torch.manual_seed(seed)
    out = fn((x, bias), residual, prob)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype))
    return out, x.grad, bias.grad, residual.grad


def test_get_bias_dropout_add_returns_megatrons_functions():
    assert fused_bias_dropout.get_bias_dropout_add(True, True) is fused_bias_dropout.bias_dropout_add_fused_train
    assert fused_bias_dropout.get_bias_dropout_add(False, True) is fused_bias_dropout.bias_dropout_add_fused_inference
    assert fused_bias_dropout.get_bias_dropout_add(True, False).__name__ == "_bias_dropout_add"


@pytest.mark.parametrize("training,prob", ((True, 0.3), (True, 0.0), (False, 0.3)))
@pytest.mark.parametrize("dtypes", ((torch.float32,) * 2, (torch.bfloat16, torch.float32)), ids=("fp32", "bf16+fp32"))
def test_bias_dropout_add_fused_on_cpu_equals_unfused_bitwise(training, prob, dtypes):
    inputs = _bda_inputs(*dtypes)
    fused = _bda_run(fused_bias_dropout.get_bias_dropout_add(training, True), inputs, prob)
    unfused = _bda_run(fused_bias_dropout.get_bias_dropout_add(training, False), inputs, prob)
    for ours, theirs in zip(fused, unfused):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    out, x, bias, residual = (t.detach().float() for t in (fused[0], *inputs))
    assert fused[0].dtype == dtypes[1]  # an fp32 residual stream stays fp32
    if not training or prob == 0.0:
        torch.testing.assert_close(out, residual + (x + bias), rtol=1e-6, atol=1e-6)
    else:
        kept = out != residual
        torch.testing.assert_close(out[kept], (residual + (x + bias) / 0.7)[kept], rtol=1e-6, atol=1e-6)
        assert 0.4 < kept.float().mean() < 0.95


def test_eval_without_gradients_adds_in_place_with_the_same_result():
    x, bias, residual = (t.detach() for t in _bda_inputs())
    expected = residual + (x + bias)
    out = fused_bias_dropout.bias_dropout_add_fused_inference((x.clone(), bias), residual.clone(), 0.5)
    assert torch.equal(out, expected)


def test_the_cuda_seed_and_offset_come_from_the_cuda_generator(monkeypatch):
    """On CUDA the kernel takes the generator's seed and offset and advances the offset past its numbers (rounded up
    to PyTorch's 4 per Philox counter), so the next random op, ours or PyTorch's, starts after them."""

    class Generator:
        def __init__(self):
            self.offset = 8

        def initial_seed(self):
            return 2**64 - 5  # a CUDA seed may use all 64 bits; Triton takes a signed 64-bit one

        def get_offset(self):
            return self.offset

        def set_offset(self, offset):
            self.offset = offset

    generator = Generator()
    monkeypatch.setattr(torch.cuda, "default_generators", (None, generator))
    cuda1 = torch.device("cuda", 1)
    assert fused_bias_dropout._philox_seed_offset(cuda1, 10) == ((2**64 - 5) % 2**63, 8)
    assert fused_bias_dropout._philox_seed_offset(cuda1, 4) == ((2**64 - 5) % 2**63, 20)
    assert generator.offset == 24


# ---- notices --------------------------------------------------------------------------------------------------------


def test_both_fusions_on_a_device_without_their_kernel_say_so_once(monkeypatch):
    monkeypatch.setattr(kernel_dispatch, "_noticed", set())
    scores = torch.empty(1, 2, 4, 4, device="meta")
    x = torch.empty(4, 1, 8, device="meta")
    with pytest.warns(UserWarning) as record:
        for _ in range(2):
            assert _softmax(True, AttnMaskType.causal)(scores, None).shape == scores.shape
            assert fused_bias_dropout.bias_dropout_add_fused_inference((x, None), x, 0.1).shape == x.shape
    assert [str(r.message) for r in record] == [
        f"{fusion}: there is no Triton kernel for meta tensors; running the PyTorch implementation (same results). "
        f"Pass {flag} to turn the fusion off"
        for fusion, flag in (
            ("masked_softmax_fusion", "--no-masked-softmax-fusion"),
            ("bias_dropout_fusion", "--no-bias-dropout-fusion"),
        )
    ]


def test_cpu_runs_both_fusions_without_a_notice(monkeypatch):
    monkeypatch.setattr(kernel_dispatch, "_noticed", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _softmax(True, AttnMaskType.causal)(torch.randn(1, 2, 4, 4), None)
        fused_bias_dropout.bias_dropout_add_fused_train((torch.randn(4, 8), torch.randn(8)), torch.randn(4, 8), 0.1)


# ---- in the model ---------------------------------------------------------------------------------------------------


def _explicit_reference(self, q, k, v, sdpa_mask, dropout_p, is_causal):
    """DotProductAttention's explicit path as it was before it went through FusedScaleMaskSoftmax."""
    from megatron.core.fusions.fused_flash_attention import attention_reference

    masked, bias = None, None
    if sdpa_mask is not None and sdpa_mask.dtype == torch.bool:
        masked = ~sdpa_mask
    elif sdpa_mask is not None:
        masked = torch.isneginf(sdpa_mask)
        bias = sdpa_mask.masked_fill(masked, 0.0)
    if is_causal:
        masked = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
    return attention_reference(
        q, k, v, self.softmax_scale, masked, bias, 0.0, dropout_p, self.config.attention_softmax_in_fp32
    )


def _attention_mismatches():
    """Cases where the unfused backend differs (at all) from the explicit reference, fusion on and off: layer and
    call mask types, a caller's mask with a fully masked row, an additive bias, one query, GQA, fp32 / bf16,
    attention dropout."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend
    from tests.unit_tests.models.gpt_test_helpers import build_config

    g = torch.Generator().manual_seed(0)
    types = (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.causal_bottom_right, AttnMaskType.padding)
    mismatches = []
    for fusion, dtype, layer_type, call_type, (sq, sk), extra in itertools.product(
        (True, False),
        (torch.float32, torch.bfloat16),
        (AttnMaskType.causal, AttnMaskType.padding),
        types,
        ((6, 6), (1, 9), (6, 9)),
        ("mask", "bias", "dropout"),
    ):
        overrides = {"num_query_groups": 2, "attention_backend": AttnBackend.unfused, "masked_softmax_fusion": fusion}
        overrides["attention_dropout"] = 0.2 if extra == "dropout" else 0.0
        attention = DotProductAttention(build_config(1, False, overrides), 1, layer_type, "self")
        q = torch.randn(sq, 2, 4, 8, generator=g).to(dtype)
        k, v = (torch.randn(sk, 2, 2, 8, generator=g).to(dtype) for _ in range(2))
        mask = torch.rand(2, 1, sq, sk, generator=g) < 0.3 if extra == "mask" else None
        if mask is not None:
            mask[0, 0, 0] = True
        bias = torch.randn(1, 4, sq, sk, generator=g) if extra == "bias" else None
        results = []
        for reference in (False, True):
            if reference:
                attention._unfused = _explicit_reference.__get__(attention)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            model_parallel_cuda_manual_seed(3)
            out = attention(*inputs, mask, attn_mask_type=call_type, attention_bias=bias)
            results.append([out, *torch.autograd.grad(out.float().sum(), inputs)])
        if not all(torch.equal(a, b) for a, b in zip(*results)):
            mismatches.append((fusion, dtype, layer_type, call_type, sq, sk, extra))
    return mismatches


def _model(fused: bool):
    from tests.unit_tests.models.gpt_test_helpers import batch, build_model, full_gradients

    overrides = {"masked_softmax_fusion": fused, "bias_dropout_fusion": fused, "attention_backend": "unfused"}
    overrides.update(hidden_dropout=0.2, attention_dropout=0.2)
    model = build_model(1, False, "gpt2", config_overrides=overrides)
    tokens, position_ids, labels = batch()
    loss = model(tokens, position_ids, None, labels=labels).sum()
    loss.backward()
    return loss.detach(), full_gradients(model)


def _in_a_worker():
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1)
    mismatches = _attention_mismatches()
    return {"attention": mismatches, "fused": _model(True), "unfused": _model(False)}


@pytest.fixture(scope="module")
def worker_results():
    return run_distributed(1, _in_a_worker)[0]


def test_unfused_attention_through_fused_softmax_equals_the_explicit_reference_bitwise(worker_results):
    assert worker_results["attention"] == []


def test_gpt_with_both_fusions_equals_the_model_without_them_bitwise(worker_results):
    (loss, grads), (ref_loss, ref_grads) = worker_results["fused"], worker_results["unfused"]
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[name], ref_grads[name]) for name in grads)
