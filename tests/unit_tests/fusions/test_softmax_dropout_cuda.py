"""The masked-softmax and bias-dropout-add kernels compiled and run on a CUDA GPU (skipped without one): against
PyTorch in fp32 and bf16, and the dropout mask's properties with the CUDA generator and the RNG tracker. Without a
GPU the same kernels are checked in Triton's interpreter (test_triton_kernels.py)."""

import pytest
import torch

from megatron.core.fusions import fused_bias_dropout, fused_softmax
from megatron.core.fusions.kernel_dispatch import HAVE_TRITON
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_TRITON), reason="needs a CUDA GPU and Triton (pip install triton)"
)

TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", TOLERANCES, ids=("fp32", "bf16"))
@pytest.mark.parametrize("mask_kind", ("causal", "mask", "none"))
def test_softmax_kernel_matches_pytorch(dtype, mask_kind):
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(2, 4, 128, 128, device="cuda", generator=g) * 3
    mask = None
    if mask_kind == "mask":
        mask = torch.rand(2, 1, 128, 128, device="cuda", generator=g) < 0.3
        mask[0, 0, 5] = True
    mask_type = AttnMaskType.causal if mask_kind == "causal" else AttnMaskType.padding
    module = fused_softmax.FusedScaleMaskSoftmax(False, False, mask_type, True, attention_mask_func, True, 0.5)
    ours = scores.to(dtype).requires_grad_()
    ref = scores.to(dtype).float().requires_grad_()
    out = module(ours, mask)
    expected = fused_softmax.scaled_masked_softmax(ref, mask, 0.5, mask_kind == "causal")
    grad = torch.randn(out.shape, device="cuda", generator=g)
    out.backward(grad.to(dtype))
    expected.backward(grad)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])
    torch.testing.assert_close(ours.grad.float(), ref.grad, **TOLERANCES[dtype])


def test_bias_dropout_add_kernel_mask():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.rand(256, 4, 512, device="cuda", generator=g) + 1.0).requires_grad_()
    bias = torch.full((512,), 0.5, device="cuda", requires_grad=True)
    residual = torch.randn(256, 4, 512, device="cuda", generator=g).requires_grad_()
    train = fused_bias_dropout.get_bias_dropout_add(True, True)
    torch.cuda.manual_seed(3)
    out = train((x, bias), residual, 0.25)
    kept = out != residual
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    scale = torch.tensor(1 / 0.75, device="cuda")
    torch.testing.assert_close(out - residual, torch.where(kept, (x + bias) * scale, 0.0), rtol=1e-6, atol=1e-6)
    grad = torch.randn(out.shape, device="cuda", generator=g)
    out.backward(grad)
    assert torch.equal(x.grad, torch.where(kept, grad * scale, 0.0))
    torch.cuda.manual_seed(3)
    assert torch.equal(train((x, bias), residual, 0.25), out)
    assert not torch.equal(train((x, bias), residual, 0.25), out)  # the offset moved on: a new mask


def test_bias_dropout_add_follows_the_rng_tracker():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    x, residual = torch.ones(64, 2, 128, device="cuda"), torch.zeros(64, 2, 128, device="cuda")
    train = fused_bias_dropout.get_bias_dropout_add(True, True)
    masks = []
    for stream_seed, default_seed in ((100, 1), (100, 2), (101, 1)):
        torch.cuda.manual_seed(default_seed)
        tracker = CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", stream_seed)
        with tracker.fork():
            masks.append(train((x, None), residual, 0.5) != 0)
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])
