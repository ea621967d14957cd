"""Run every Triton kernel of megatron.core.fusions in Triton's CPU interpreter against its PyTorch reference.

Started as a subprocess by test_triton_kernels.py: TRITON_INTERPRET must be set before Triton is first imported, and
setting it in the test process would change Triton for every other test. Prints one JSON object mapping each case
``fusion/dtype`` to None (forward and backward match the reference) or the mismatch message.

With ``--cuda`` (on a GPU machine: benchmarks/gpu_check.sh) the same checks run the compiled kernels on CUDA tensors
instead of the interpreter.
"""

import json
import os
import sys

DEVICE = "cuda" if "--cuda" in sys.argv else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu, fused_cross_entropy  # noqa: E402
from megatron.core.fusions import fused_layer_norm, fused_rope  # noqa: E402
from megatron.core.fusions import fused_weight_gradient  # noqa: E402
from megatron.core.fusions.fused_layer_norm import fused_norm  # noqa: E402
from megatron.core.fusions import fused_bias_dropout, fused_softmax  # noqa: E402
from megatron.core.transformer.rope_utils import apply_rotary_pos_emb_with_cos_sin  # noqa: E402

# The PyTorch bodies must not run here: a check that silently fell back to them would compare PyTorch with itself.
PYTORCH_BODIES = {
    fused_bias_swiglu: ("swiglu", "bias_swiglu", "swiglu_back", "bias_swiglu_back"),
    fused_bias_gelu: ("bias_gelu", "bias_gelu_back"),
    fused_layer_norm: ("_torch_norm",),
    fused_cross_entropy: ("cross_entropy_statistics", "cross_entropy_backward", "_eager_forward", "_softmax_backward"),
    fused_softmax: ("scaled_masked_softmax", "scaled_softmax_back"),
    fused_bias_dropout: ("_bias_dropout_add_func",),
    fused_weight_gradient: ("_pytorch_wgrad_accum",),
}

# Storage-precision tolerances: the kernels compute in fp32 and round once when storing.
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _compare(kernel_fn, reference_fn, inputs, dtype):
    """Forward outputs and input gradients of ``kernel_fn`` vs ``reference_fn`` (run in fp32 on the same values)."""
    ours = [x.detach().to(DEVICE, dtype).requires_grad_(x.is_floating_point()) for x in inputs]
    ref = [x.detach().to(DEVICE, dtype).float().requires_grad_(x.is_floating_point()) for x in inputs]
    out, expected = kernel_fn(*ours), reference_fn(*ref)
    grad = torch.randn_like(expected)
    out.backward(grad.to(out.dtype))
    expected.backward(grad)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype], msg=lambda m: f"forward: {m}")
    for mine, theirs in zip(ours, ref):
        if mine.grad is not None:
            scale = theirs.grad.abs().max().clamp_min(1.0)  # bias gradients sum many rows
            torch.testing.assert_close(
                mine.grad.float() / scale, theirs.grad / scale, **TOLERANCES[dtype], msg=lambda m: f"backward: {m}"
            )


def _reference_gelu(y, bias):
    x = y + bias
    return F.gelu(x, approximate="tanh")


def _cases():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(6, 2 * 40, generator=g) * 3
    bias = torch.randn(2 * 40, generator=g)
    x = torch.randn(2, 3, 48, generator=g) * 2 + 0.5
    w, b = torch.randn(48, generator=g), torch.randn(48, generator=g)
    logits = torch.randn(5, 70, generator=g) * 4
    target = torch.randint(0, 70, (5,), generator=g).to(DEVICE)

    def swiglu_ref(y, bias=None):
        a, c = torch.chunk(y if bias is None else y + bias, 2, -1)
        return F.silu(a) * c

    def ce_ref(logits):
        return F.cross_entropy(logits, target, reduction="none")

    yield "bias_swiglu", lambda y, bias: fused_bias_swiglu.bias_swiglu_impl(y, bias), swiglu_ref, (y, bias)
    yield "swiglu", lambda y: fused_bias_swiglu.bias_swiglu_impl(y, None), swiglu_ref, (y,)
    yield "bias_gelu", lambda y, bias: fused_bias_gelu.bias_gelu_impl(y, bias), _reference_gelu, (y, bias)
    for norm in ("LayerNorm", "RMSNorm"):

        def norm_ref(x, w, b, norm=norm):
            if norm == "RMSNorm":
                return F.rms_norm(x, (48,), w, 1e-5)
            return F.layer_norm(x, (48,), w, b, 1e-5)

        yield norm, lambda x, w, b, norm=norm: fused_norm(x, w, b, 1e-5, norm), norm_ref, (x, w, b)
    ce = fused_cross_entropy.fused_vocab_parallel_cross_entropy
    yield "cross_entropy", lambda logits: ce(logits, target, None), ce_ref, (logits,)
    # RoPE on [s, b, heads, head_dim] with partial rotary (12 of 16 channels rotated, 4 passed through).
    t = torch.randn(5, 2, 3, 16, generator=g)
    angles = torch.randn(5, 1, 1, 6, generator=g) * 3
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = torch.cos(angles).to(DEVICE), torch.sin(angles).to(DEVICE)

    def rope_ref(t):
        return apply_rotary_pos_emb_with_cos_sin(t, cos, sin)

    yield "rope", lambda t: fused_rope.fused_apply_rotary_pos_emb(t, cos, sin), rope_ref, (t,)
    yield from _softmax_cases(g)
    yield from _bias_dropout_add_cases(g)


def _softmax_cases(g):
    """FusedScaleMaskSoftmax with the fusion on: causal (generated mask), a given mask broadcast over heads with one
    fully masked row (zeros), a padding mask broadcast over heads and queries, and no mask; against fp32 PyTorch
    with masked keys left out."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    scores = torch.randn(2, 3, 5, 5, generator=g) * 3
    mask = torch.rand(2, 1, 5, 5, generator=g) < 0.4
    mask[1, 0, 2] = True
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)

    def module(mask_type):
        return fused_softmax.FusedScaleMaskSoftmax(False, False, mask_type, True, attention_mask_func, True, 0.7)

    def ref(x, hidden):
        probs = torch.softmax((x * 0.7).masked_fill(hidden, float("-inf")), dim=-1)
        return probs.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)

    yield "softmax_causal", lambda x: module(AttnMaskType.causal)(x, None), lambda x: ref(x, causal), (scores,)
    yield "softmax_masked", lambda x: module(AttnMaskType.padding)(x, mask), lambda x: ref(x, mask), (scores,)
    padding = mask[:, :, :1]  # [b, 1, 1, sk]: broadcast over heads and queries
    yield "softmax_padding", lambda x: module(AttnMaskType.padding)(x, padding), lambda x: ref(x, padding), (scores,)
    no_mask = torch.zeros(5, dtype=torch.bool)
    yield "softmax", lambda x: module(AttnMaskType.no_mask)(x, None), lambda x: ref(x, no_mask), (scores,)


def _bias_dropout_add_cases(g):
    """bias + dropout + add without dropout (inference, and training with p = 0): exactly residual + x + bias."""
    x, bias, residual = torch.randn(4, 2, 24, generator=g), torch.randn(24, generator=g), torch.randn(4, 2, 24)

    def ref(x, bias, residual):
        return residual + (x + bias)

    train = fused_bias_dropout.get_bias_dropout_add(True, True)
    infer = fused_bias_dropout.get_bias_dropout_add(False, True)
    yield "bias_dropout_add_p0", lambda x, b, r: train((x, b), r, 0.0), ref, (x, bias, residual)
    yield "bias_dropout_add_inference", lambda x, b, r: infer((x, b), r, 0.3), ref, (x, bias, residual)


def _check_dropout(p: float) -> None:
    """With ``p > 0``: about ``1 - p`` of the elements kept, each exactly ``(x + bias) / (1 - p)``; backward hands
    the gradient through exactly where forward kept (scaled the same) and nowhere else; the same seed gives the same
    mask, another seed another one."""
    g = torch.Generator().manual_seed(7)
    x = torch.rand(64, 2, 48, generator=g) + 1.0  # x + bias >= 1.5: a dropped element is the only out == residual
    bias = torch.full((48,), 0.5).requires_grad_()
    residual = torch.randn(64, 2, 48, generator=g).requires_grad_()
    x.requires_grad_()
    train = fused_bias_dropout.get_bias_dropout_add(True, True)
    torch.manual_seed(11)
    out = train((x, bias), residual, p)
    kept = out != residual
    scale = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)
    fraction = kept.float().mean().item()
    assert abs(fraction - (1.0 - p)) < 0.03, f"kept fraction {fraction}, expected about {1.0 - p}"
    expected = torch.where(kept, (x + bias) * scale, 0.0)
    torch.testing.assert_close(out - residual, expected, rtol=1e-6, atol=1e-6)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    assert torch.equal(x.grad, torch.where(kept, grad * scale, 0.0)), "backward used another mask than forward"
    assert torch.equal(residual.grad, grad)
    torch.testing.assert_close(bias.grad, torch.where(kept, grad * scale, 0.0).sum((0, 1)))
    torch.manual_seed(11)
    assert torch.equal(train((x, bias), residual, p), out), "the same seed gave another mask"
    torch.manual_seed(12)
    assert not torch.equal(train((x, bias), residual, p) != residual, kept), "another seed gave the same mask"


def _check_no_dropout_is_exact() -> None:
    """p = 0 in fp32: bitwise residual + (x + bias), PyTorch's order of the two fp32 additions."""
    g = torch.Generator().manual_seed(8)
    x, bias, residual = torch.randn(3, 2, 40, generator=g), torch.randn(40, generator=g), torch.randn(3, 2, 40)
    out = fused_bias_dropout.get_bias_dropout_add(True, True)((x, bias), residual, 0.0)
    assert torch.equal(out, residual + (x + bias)), "p = 0 differs from residual + (x + bias)"


def _check_the_rng_tracker_governs_the_mask() -> None:
    """The kernel's seed comes from the generator a tracker stream forks (the CPU one here, the CUDA one on a GPU):
    a stream gives the same mask whatever the default generator did, another stream another mask."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    x, residual = torch.ones(8, 2, 32), torch.zeros(8, 2, 32)
    train = fused_bias_dropout.get_bias_dropout_add(True, True)
    masks = []
    for stream_seed, default_seed in ((100, 1), (100, 2), (101, 1)):
        torch.manual_seed(default_seed)
        tracker = CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", stream_seed)
        with tracker.fork():
            masks.append(train((x, None), residual, 0.5) != 0)
    assert torch.equal(masks[0], masks[1]), "the default generator changed the stream's mask"
    assert not torch.equal(masks[0], masks[2]), "two streams gave the same mask"


CHECKS = {
    "bias_dropout_add_p0_exact": _check_no_dropout_is_exact,
    "bias_dropout_add_rng_tracker": _check_the_rng_tracker_governs_the_mask,
    "bias_dropout_add_p0.3": lambda: _check_dropout(0.3),
    "bias_dropout_add_p0.75": lambda: _check_dropout(0.75),
}


def _check_wgrad_accum(dtype):
    """``main_grad += grad_output^T @ input`` onto a nonzero ``main_grad``, on shapes that are no multiple of any tile
    (two tiles of output rows, a partial token step), directly and through a linear layer's backward."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    g = torch.Generator().manual_seed(1)
    go, x = torch.randn(70, 133, generator=g).to(DEVICE, dtype), torch.randn(70, 45, generator=g).to(DEVICE, dtype)
    start = torch.randn(133, 45, generator=g).to(DEVICE)
    expected = start + go.double().t().matmul(x.double()).float()
    # fp32 sums of 70 products: fp32 / bf16 storage of the inputs, one rounding when main_grad is bf16.
    main_grads = [(torch.float32, dict(rtol=1e-5, atol=1e-4))]
    if dtype != torch.float32:
        main_grads.append((torch.bfloat16, dict(rtol=1e-2, atol=5e-2)))
    for main_dtype, tolerance in main_grads:
        main_grad = start.clone().to(main_dtype)
        fused_weight_gradient.wgrad_gemm_accum(x, go, main_grad)
        torch.testing.assert_close(main_grad.float(), expected, **tolerance, msg=lambda m: f"main_grad: {m}")
    weight = torch.nn.Parameter(torch.randn(133, 45, generator=g).to(DEVICE, dtype))
    weight.main_grad = start.clone()
    inp = x.view(35, 2, 45).requires_grad_()
    out = linear_with_grad_accumulation_and_async_allreduce(inp, weight, None, True, False, False)
    out.backward(go.view(35, 2, 133))
    torch.testing.assert_close(weight.main_grad, expected, **main_grads[0][1], msg=lambda m: f"layer: {m}")
    assert weight.grad is not None and not weight.grad.any(), "the layer's placeholder gradient is not zero"


def _forbid_pytorch_bodies():
    for module, names in PYTORCH_BODIES.items():
        for name in names:

            def forbidden(*args, name=name, **kwargs):
                raise AssertionError(f"the PyTorch body {name} ran instead of the Triton kernel")

            setattr(module, name, forbidden)


def main():
    _forbid_pytorch_bodies()
    results = {}
    for name, kernel_fn, reference_fn, inputs in _cases():
        for dtype in TOLERANCES:
            try:
                _compare(kernel_fn, reference_fn, inputs, dtype)
                results[f"{name}/{str(dtype).removeprefix('torch.')}"] = None
            except Exception as error:  # noqa: BLE001 - every failure is reported to the test, by case
                results[f"{name}/{str(dtype).removeprefix('torch.')}"] = f"{type(error).__name__}: {error}"
    # The dropout checks build CPU tensors (on a GPU, test_softmax_dropout_cuda.py checks the compiled kernel).
    for name, check in CHECKS.items() if DEVICE == "cpu" else ():
        try:
            check()
            results[name] = None
        except Exception as error:  # noqa: BLE001 - every failure is reported to the test, by case
            results[name] = f"{type(error).__name__}: {error}"
    for dtype in TOLERANCES:
        key = f"wgrad_accum/{str(dtype).removeprefix('torch.')}"
        try:
            _check_wgrad_accum(dtype)
            results[key] = None
        except Exception as error:  # noqa: BLE001 - every failure is reported to the test, by case
            results[key] = f"{type(error).__name__}: {error}"
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
