"""The fusions on CPU: each PyTorch body against PyTorch's own ops (forward and backward), the fallback notices,
and a GPT model with the fusions on against the same model with them off (TP=2 fused vs TP=1 unfused)."""

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu, fused_cross_entropy, fused_rope, kernel_dispatch
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.fusions.fused_layer_norm import fused_norm
from megatron.core.transformer.mlp import MLP
from tests.unit_tests.models.gpt_test_helpers import assert_close_dicts, batch, build_model, full_gradients
from tests.unit_tests.test_utilities import run_distributed


def _grads_match(fused_fn, reference_fn, inputs, tolerance=1e-6):
    """Forward and every input gradient of ``fused_fn`` equal ``reference_fn``'s."""
    ours = [x.clone().requires_grad_() for x in inputs]
    ref = [x.clone().requires_grad_() for x in inputs]
    out, expected = fused_fn(*ours), reference_fn(*ref)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=tolerance, atol=tolerance)


def _swiglu_reference(y, bias=None):
    gate, up = torch.chunk(y if bias is None else y + bias, 2, -1)
    return F.silu(gate) * up


def test_swiglu_cpu_paths_match_autograd():
    g = torch.Generator().manual_seed(0)
    y, bias = torch.randn(3, 2, 16, generator=g) * 3, torch.randn(16, generator=g)
    _grads_match(lambda y, b: fused_bias_swiglu.bias_swiglu_impl(y, b), _swiglu_reference, (y, bias))
    _grads_match(lambda y: fused_bias_swiglu.bias_swiglu_impl(y, None), _swiglu_reference, (y,))
    # Megatron's autograd functions with their hand-written backward (the Triton path's shape) agree too.
    flat = y.reshape(-1, 16)
    _grads_match(lambda y, b: fused_bias_swiglu.BiasSwiGLUFunction.apply(y, b), _swiglu_reference, (flat, bias))
    _grads_match(lambda y: fused_bias_swiglu.SwiGLUFunction.apply(y), _swiglu_reference, (flat,))


def test_swiglu_rejects_a_4d_input():
    with pytest.raises(ValueError, match=r"bias_swiglu_impl takes a 2-D or 3-D input, got shape \(1, 1, 1, 4\)"):
        fused_bias_swiglu.bias_swiglu_impl(torch.zeros(1, 1, 1, 4), None)


def test_bias_gelu_is_the_tanh_approximation():
    g = torch.Generator().manual_seed(1)
    y, bias = torch.randn(4, 2, 8, generator=g) * 3, torch.randn(8, generator=g)

    def reference(y, b):
        return F.gelu(y + b, approximate="tanh")

    _grads_match(fused_bias_gelu.bias_gelu_impl, reference, (y, bias), tolerance=1e-5)
    _grads_match(fused_bias_gelu.GeLUFunction.apply, reference, (y, bias), tolerance=1e-5)


@pytest.mark.parametrize("normalization", ("LayerNorm", "RMSNorm"))
def test_fused_norm_on_cpu_is_torch_norm(normalization):
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 2, 32, generator=g), torch.randn(32, generator=g), torch.randn(32, generator=g)

    def reference(x, w, b):
        if normalization == "RMSNorm":
            return F.rms_norm(x, (32,), w, 1e-5) + 0 * b
        return F.layer_norm(x, (32,), w, b, 1e-5)

    def fused(x, w, b):
        return fused_norm(x, w, b, 1e-5, normalization) + (0 * b if normalization == "RMSNorm" else 0)

    _grads_match(fused, reference, (x, w, b))


@pytest.mark.parametrize("recompute", (False, True), ids=("eager-softmax", "recompute"))
def test_fused_cross_entropy_matches_torch(monkeypatch, recompute):
    if recompute:  # the Triton / compiled order (statistics, then recompute in backward), run eagerly
        monkeypatch.setattr(fused_cross_entropy, "compile_cpu_fusions", lambda: True)
        monkeypatch.setattr(fused_cross_entropy, "cpu_body", lambda fn: fn)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 50, generator=g) * 4
    logits[0, 0, 5] += 1e4  # far outside exp()'s range: only a max-shifted softmax survives this
    target = torch.randint(0, 50, (4, 3), generator=g)

    def reference(logits):
        return F.cross_entropy(logits.reshape(-1, 50), target.reshape(-1), reduction="none").view(4, 3)

    def fused(logits):
        return fused_cross_entropy.fused_vocab_parallel_cross_entropy(logits, target, None)

    _grads_match(fused, reference, (logits,))


# ---- notices --------------------------------------------------------------------------------------------------------


def test_fallback_reasons():
    assert kernel_dispatch.fallback_reason("cuda", torch.bfloat16, have_triton=True) is None
    no_triton = kernel_dispatch.fallback_reason("cuda", torch.bfloat16, have_triton=False)
    assert no_triton == "Triton is not installed (pip install triton)"
    assert kernel_dispatch.fallback_reason("cuda", torch.float64, True) == (
        "the Triton kernel does not take torch.float64 tensors"
    )
    assert kernel_dispatch.fallback_reason("mps", torch.float32, True) == "there is no Triton kernel for mps tensors"


def test_a_fusion_on_a_device_without_its_kernel_says_so_once(monkeypatch):
    monkeypatch.setattr(kernel_dispatch, "_noticed", set())
    x, w = torch.empty(2, 8, device="meta"), torch.empty(8, device="meta")
    with pytest.warns(UserWarning) as record:
        out = fused_norm(x, w, None, 1e-5, "RMSNorm")
        fused_norm(x, w, None, 1e-5, "RMSNorm")
    assert out.shape == (2, 8)
    assert [str(r.message) for r in record] == [
        "persist_layer_norm: there is no Triton kernel for meta tensors; running the PyTorch implementation (same "
        "results). Pass --no-persist-layer-norm to turn the fusion off"
    ]


def test_interleaved_rope_on_a_gpu_says_it_runs_unfused(monkeypatch):
    monkeypatch.setattr(kernel_dispatch, "_noticed", set())
    with pytest.warns(UserWarning, match="apply_rope_fusion: no kernel for interleaved rotary channels; running the "):
        assert not fused_rope.fused_rope_available(torch.empty(2, 8, device="meta"), rotary_interleaved=True)
    assert not fused_rope.fused_rope_available(torch.empty(2, 8), rotary_interleaved=False)  # CPU: PyTorch's code


def test_cpu_runs_the_fusions_without_a_notice(monkeypatch):
    monkeypatch.setattr(kernel_dispatch, "_noticed", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused_bias_swiglu.bias_swiglu_impl(torch.randn(2, 8), None)
        fused_norm(torch.randn(2, 8), torch.ones(8), None, 1e-5, "RMSNorm")


def test_activation_without_a_fused_kernel_gets_one_notice(monkeypatch):
    from megatron.core.activations import squared_relu

    monkeypatch.setattr(kernel_dispatch, "_noticed", set())
    config = SimpleNamespace(gated_linear_unit=False)
    with pytest.warns(UserWarning, match="bias_activation_fusion: no fused kernel for the activation squared_relu"):
        assert MLP._select_fused_activation(SimpleNamespace(activation_func=squared_relu), config) is None
    gated_silu = SimpleNamespace(activation_func=F.silu)
    assert MLP._select_fused_activation(gated_silu, SimpleNamespace(gated_linear_unit=True)) is bias_swiglu_impl


# ---- the model with the fusions on vs off ---------------------------------------------------------------------------

FUSIONS_ON = {
    "bias_activation_fusion": True,
    "persist_layer_norm": True,
    "cross_entropy_loss_fusion": True,
    "apply_rope_fusion": True,
}


def _loss_and_grads(tp, variant, overrides):
    model = build_model(tp, False, variant, config_overrides=overrides)
    tokens, position_ids, labels = batch()
    loss = model(tokens, position_ids, None, labels=labels).sum()
    loss.backward()
    layer = model.decoder.layers[0]
    fused = (getattr(layer.mlp.fused_activation, "__name__", None), layer.input_layernorm.fused)
    return loss.detach(), full_gradients(model), fused


def _recomputing_cross_entropy_at_tp2():
    """The Triton path's order (per-rank statistics combined over TP, softmax recomputed in backward), run eagerly
    on this rank's half of the vocabulary: ``(loss, full logits gradient)`` and F.cross_entropy's."""
    from megatron.core import parallel_state
    from tests.unit_tests.models.gpt_test_helpers import gather_logits

    g = torch.Generator().manual_seed(5)
    logits, target = torch.randn(6, 3, 40, generator=g) * 4, torch.randint(0, 40, (6, 3), generator=g)
    group = parallel_state.get_tensor_model_parallel_group()
    shard = logits.chunk(2, dim=-1)[torch.distributed.get_rank(group)].clone().requires_grad_()
    original = (fused_cross_entropy.compile_cpu_fusions, fused_cross_entropy.cpu_body)
    fused_cross_entropy.compile_cpu_fusions, fused_cross_entropy.cpu_body = (lambda: True), (lambda fn: fn)
    try:
        loss = fused_cross_entropy.fused_vocab_parallel_cross_entropy(shard, target, group)
    finally:
        fused_cross_entropy.compile_cpu_fusions, fused_cross_entropy.cpu_body = original
    weights = torch.rand(6, 3, generator=g)
    (loss * weights).sum().backward()
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.reshape(-1, 40), target.reshape(-1), reduction="none").view(6, 3)
    (expected * weights).sum().backward()
    return (loss.detach(), gather_logits(shard.grad)), (expected.detach(), full.grad)


def _fused_vs_unfused():
    """On each of 2 ranks: Llama (RMSNorm, SwiGLU without bias) at TP=2 fused vs TP=1 unfused; GPT-2 (LayerNorm,
    GeLU with bias) fused vs unfused with GeLU's tanh approximation (which the fused GeLU computes); the recomputing
    cross entropy at TP=2 vs F.cross_entropy."""
    tanh_gelu = {"activation_func": lambda x: F.gelu(x, approximate="tanh")}
    llama = (_loss_and_grads(2, "llama", FUSIONS_ON), _loss_and_grads(1, "llama", {}))
    build_model(2, False, "llama")  # TP=2 groups for the cross entropy
    return {
        "cross_entropy_tp2": _recomputing_cross_entropy_at_tp2(),
        "llama": llama,
        "gpt2": (_loss_and_grads(1, "gpt2", FUSIONS_ON), _loss_and_grads(1, "gpt2", tanh_gelu)),
    }


@pytest.fixture(scope="module")
def fused_vs_unfused():
    return run_distributed(2, _fused_vs_unfused)[0]


@pytest.mark.parametrize("variant,activation", (("llama", "bias_swiglu_impl"), ("gpt2", "bias_gelu_impl")))
def test_model_with_fusions_matches_unfused(fused_vs_unfused, variant, activation):
    (fused_loss, fused_grads, fused), (loss, grads, unfused) = fused_vs_unfused[variant]
    assert fused == (activation, True) and unfused == (None, False)  # the fused paths ran
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=0)
    assert_close_dicts(fused_grads, grads, tolerance=1e-5, what=variant)


def test_recomputing_cross_entropy_at_tp2_matches_torch(fused_vs_unfused):
    (loss, grad), (expected, expected_grad) = fused_vs_unfused["cross_entropy_tp2"]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
