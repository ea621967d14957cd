"""FP8 quantisation of each recipe against torchao's reference functions (an independent implementation), and
hand-checked bytes: saturation at 448 / 57344, subnormals, signed zero, all-zero tensors and blocks."""

import warnings

import pytest
import torch

from megatron.core.fp8.quantization import (
    E4M3,
    E5M2,
    amax_to_scale,
    e8m0_bytes,
    quantize_blockwise,
    quantize_mxfp8,
    quantize_tensorwise,
    saturating_cast,
)
from megatron.core.fp8.recipe import DelayedScalingState, Fp8ScalingRecipe

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torchao = pytest.importorskip("torchao")
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.blockwise_fp8_training.kernels import (
        torch_blockwise_scale_act_quant_lhs,
        torch_blockwise_scale_weight_quant,
    )
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.fixture(scope="module")
def wide_range():
    """256 x 256 values over twelve decades (each column its own magnitude), with one all-zero 128-column tile."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=generator) * torch.logspace(-6, 6, 256)
    x[:128, 128:] = 0
    return x


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_tensorwise_matches_torchao(wide_range, fp8_dtype):
    ours = quantize_tensorwise(wide_range, fp8_dtype)
    scale = tensor_to_scale(wide_range, fp8_dtype)
    assert torch.equal(_bytes(ours.data), _bytes(to_fp8_saturated(wide_range * scale, fp8_dtype)))
    assert torch.equal(ours.scale_inv, scale.reciprocal())
    assert torch.allclose(ours.dequantize(), ours.data.float() / scale, rtol=1e-7, atol=0)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_mxfp8_matches_torchao_rceil(wide_range, fp8_dtype):
    ours = quantize_mxfp8(wide_range, fp8_dtype)
    scale_e8m0, data = to_mx(wide_range, fp8_dtype, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(_bytes(ours.data), _bytes(data))
    assert torch.equal(e8m0_bytes(ours.scale_inv).reshape(-1), scale_e8m0.view(torch.uint8).reshape(-1))
    # Dequantisation agrees bit for bit: power-of-two scales are exact. (torchao decodes an all-zero block's E8M0
    # byte 0 as 2**-127; either way its values are zero.)
    assert torch.equal(ours.dequantize(), to_dtype(data, scale_e8m0, fp8_dtype, 32, torch.float32))


def test_blockwise_matches_torchao_deepseek_tiles(wide_range):
    activation = quantize_blockwise(wide_range, E4M3, (1, 128))
    data, scale_inv = torch_blockwise_scale_act_quant_lhs(wide_range, 128, E4M3)
    assert torch.equal(_bytes(activation.data), _bytes(data)) and torch.equal(activation.scale_inv, scale_inv)
    weight = quantize_blockwise(wide_range, E4M3, (128, 128))
    data, scale_inv = torch_blockwise_scale_weight_quant(wide_range, 128, E4M3)
    assert torch.equal(_bytes(weight.data), _bytes(data)) and torch.equal(weight.scale_inv, scale_inv)
    assert weight.scale_inv.shape == (2, 2)
    # The all-zero tile stays zero, with a finite scale.
    assert not weight.data[:128, 128:].float().any() and torch.isfinite(weight.scale_inv).all()


def test_saturation_subnormals_and_zeros_byte_for_byte():
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, 448.0, 1000.0, -1e9, 2.0**-9, 2.0**-10, 3 * 2.0**-10])
    # E4M3 (bias 7): 448 = 0x7E is the largest finite value (0x7F is NaN); 2**-9 = 0x01 the smallest subnormal;
    # 2**-10 rounds (to even) to zero and 1.5 * 2**-9 up to 2 * 2**-9 = 0x02.
    expected = [0x00, 0x80, 0x38, 0xB8, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x02]
    assert _bytes(saturating_cast(values, E4M3)).tolist() == expected
    values = torch.tensor([0.0, 1.0, -1.0, 57344.0, 1e6, -1e9, 2.0**-16, 2.0**-17])
    # E5M2 (bias 15): 57344 = 0x7B is the largest finite value; 2**-16 = 0x01 the smallest subnormal.
    assert _bytes(saturating_cast(values, E5M2)).tolist() == [0x00, 0x3C, 0xBC, 0x7B, 0x7B, 0xFB, 0x01, 0x00]


def test_hand_checked_scales():
    # Per tensor: amax 2 -> scale 224, so the amax lands on 448 (0x7E); an all-zero tensor stays zero.
    q = quantize_tensorwise(torch.tensor([2.0, -1.0, 0.5]), E4M3)
    assert q.scale_inv.item() == torch.tensor(224.0).reciprocal().item()
    assert _bytes(q.data).tolist() == [0x7E, 0xF6, 0x6E]  # 448, -224, 112
    zeros = quantize_tensorwise(torch.zeros(4), E5M2)
    assert not zeros.data.float().any() and torch.isfinite(zeros.scale_inv)
    # MXFP8 blocks (E4M3): amax 448 -> 2**0 (byte 127); amax 449 -> 2**1 (byte 128, 449 / 2 rounds to 224);
    # amax 1 -> 2**ceil(log2(1 / 448)) = 2**-8 (byte 119, 1.0 stored as 256 = 0x78); all zeros -> byte 0.
    blocks = torch.zeros(4, 32)
    blocks[0, 0], blocks[1, 0], blocks[2, 0] = 448.0, 449.0, 1.0
    q = quantize_mxfp8(blocks, E4M3)
    assert e8m0_bytes(q.scale_inv).reshape(-1).tolist() == [127, 128, 119, 0]
    assert q.data[:3, 0].float().tolist() == [448.0, 224.0, 256.0] and _bytes(q.data[2, :1]).tolist() == [0x78]
    assert not q.data[3].float().any()
    # Delayed scaling's margin halves the scale per step of margin.
    assert amax_to_scale(torch.tensor(2.0), E4M3, margin=1).item() == 112.0


def test_delayed_scaling_uses_the_history_then_records():
    recipe = Fp8ScalingRecipe(recipe="delayed", amax_history_len=3, amax_compute_algo="max")
    state = DelayedScalingState(3)
    first = state.quantize(0, torch.tensor([4.0, -1.0]), E4M3, recipe, None)
    assert first.scale_inv.item() == 1.0  # before any history the scale is 1
    assert state.scale[0].item() == 112.0  # 448 / 4, for the next step
    state.quantize(0, torch.tensor([2.0]), E4M3, recipe, None)
    assert state.amax_history[:, 0].tolist() == [2.0, 4.0, 0.0] and state.scale[0].item() == 112.0  # max(2, 4)
    recent = DelayedScalingState(3)
    for amax in (4.0, 2.0):
        recent.quantize(0, torch.tensor([amax]), E4M3, Fp8ScalingRecipe(recipe="delayed", amax_history_len=3), None)
    assert recent.scale[0].item() == 224.0  # most_recent: 448 / 2
    # Beyond the scale the values saturate instead of overflowing to NaN.
    q = recent.quantize(0, torch.tensor([10.0]), E4M3, Fp8ScalingRecipe(recipe="delayed"), None)
    assert q.dequantize().item() == 2.0  # 448 / 224
