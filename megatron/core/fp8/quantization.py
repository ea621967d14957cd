"""FP8 quantisation in pure PyTorch: per-tensor, per-block (MXFP8) and per-tile (DeepSeek-V3 blockwise) scaling.

A quantised tensor is the FP8 data (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, same shape as the source) and
the dequantisation multipliers ``scale_inv``: one per scaling block, so ``data * scale_inv`` (each block's multiplier
broadcast over its block) is the value the FP8 GEMM sees. Casts saturate (values beyond the format's largest finite
number, 448 for E4M3 and 57344 for E5M2, become that number), as Transformer Engine's and torchao's casts do.

Scale rules, all computed in float32 from the block's largest magnitude ``amax``:

- ``scale = fp8_max / max(amax, 1e-12)`` (per tensor: the tensorwise and delayed recipes; per 1x128 / 128x128 tile:
  the blockwise recipe, with float32 scales as in DeepSeek-V3), divided by ``2**margin`` for delayed scaling;
- MXFP8: a power of two stored as an E8M0 byte, ``2**ceil(log2(amax / fp8_max))`` (the rounding cuBLAS and
  Transformer Engine use, "RCEIL", so a block's largest value never saturates).

Blocks run along the last dimension of a 2-D operand (its GEMM contraction dimension); a tensor whose size is not
a multiple of the block is padded with zeros for the amax (zeros change no block's maximum) and cropped after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
"""The largest finite value of each FP8 format."""

AMAX_EPSILON = 1e-12
"""Floor for a block's amax, so an all-zero block gets a finite scale (its data stays zero)."""

MXFP8_BLOCK = 32
BLOCKWISE_TILE = 128
_E8M0_BIAS = 127


@dataclass
class QuantizedTensor:
    """FP8 ``data`` with its dequantisation multipliers ``scale_inv`` (``[rows / block[0], cols / block[1]]``,
    rounded up; a 0-d tensor for one per-tensor scale) and the scaling ``block`` (None for per-tensor)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Optional[Tuple[int, int]] = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values the FP8 GEMM multiplies, in ``dtype`` (exact in float32: an FP8 value times a float32
        scale)."""
        values = self.data.to(torch.float32)
        if self.block is None:
            return (values * self.scale_inv).to(dtype)
        rows, cols = self.data.shape
        scales = self.scale_inv.repeat_interleave(self.block[0], 0).repeat_interleave(self.block[1], 1)
        return (values * scales[:rows, :cols]).to(dtype)

    def t(self) -> "QuantizedTensor":
        """The transpose (data and per-block scales); valid for per-tensor and square-tile scaling, whose blocks
        are the same in both directions."""
        if self.block is not None and self.block[0] != self.block[1]:
            raise ValueError(f"a QuantizedTensor with {self.block} blocks has no transpose of the same scaling")
        scale_inv = self.scale_inv if self.block is None else self.scale_inv.t()
        return QuantizedTensor(self.data.t(), scale_inv, self.block)


def saturating_cast(values: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``fp8_dtype``, clamped to its finite range first (a plain cast of an out-of-range value
    gives NaN in E4M3 and inf in E5M2)."""
    fp8_max = FP8_MAX[fp8_dtype]
    return values.clamp(-fp8_max, fp8_max).to(fp8_dtype)


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The quantisation multiplier ``fp8_max / amax / 2**margin`` in float32 (computed in float64 so it rounds
    once)."""
    amax = amax.to(torch.float64).clamp(min=AMAX_EPSILON)
    return (FP8_MAX[fp8_dtype] / amax / 2.0**margin).to(torch.float32)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> QuantizedTensor:
    """Per-tensor quantisation with a given float32 ``scale`` (the delayed recipe's, or the current amax's)."""
    data = saturating_cast(x.to(torch.float32) * scale, fp8_dtype)
    return QuantizedTensor(data, scale.reciprocal())


def quantize_tensorwise(x: torch.Tensor, fp8_dtype: torch.dtype, amax: Optional[torch.Tensor] = None):
    """Current per-tensor scaling: one scale from ``amax`` (this tensor's largest magnitude unless given, e.g.
    already reduced over the ranks that hold the other pieces of the tensor)."""
    if amax is None:
        amax = x.detach().abs().amax().to(torch.float32)
    return quantize_with_scale(x, amax_to_scale(amax, fp8_dtype), fp8_dtype)


def _blocks(x: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """``x`` (2-D) zero-padded to whole blocks, as ``[row blocks, rows, col blocks, cols]``."""
    if x.dim() != 2:
        raise ValueError(f"block quantisation takes a 2-D operand, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    pad_rows, pad_cols = -rows % block[0], -cols % block[1]
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, pad_cols, 0, pad_rows))
    return padded.reshape((rows + pad_rows) // block[0], block[0], (cols + pad_cols) // block[1], block[1])


def _quantize_blocks(x: torch.Tensor, block: Tuple[int, int], fp8_dtype: torch.dtype, power_of_two: bool):
    blocks = _blocks(x, block)
    amax = blocks.abs().amax(dim=(1, 3))
    if power_of_two:
        exponent = torch.ceil(torch.log2(amax / FP8_MAX[fp8_dtype])).clamp(-_E8M0_BIAS, _E8M0_BIAS)
        scale_inv = torch.exp2(exponent)
        # An all-zero block (exponent clamped to the bottom) is scaled by 1: its data is zero either way.
        scale = torch.where(amax > 0, torch.exp2(-exponent), torch.ones_like(amax))
    else:
        scale = amax_to_scale(amax, fp8_dtype)
        scale_inv = scale.reciprocal()
    scaled = blocks * scale[:, None, :, None]
    rows, cols = x.shape
    data = saturating_cast(scaled.reshape(blocks.shape[0] * block[0], -1)[:rows, :cols], fp8_dtype)
    return QuantizedTensor(data, scale_inv, block)


def quantize_mxfp8(x: torch.Tensor, fp8_dtype: torch.dtype = E4M3, block_size: int = MXFP8_BLOCK):
    """MXFP8: ``block_size`` consecutive elements of a row share one power-of-two (E8M0) scale."""
    return _quantize_blocks(x, (1, block_size), fp8_dtype, power_of_two=True)


def quantize_blockwise(x: torch.Tensor, fp8_dtype: torch.dtype, tile: Tuple[int, int]):
    """DeepSeek-V3 block scaling: one float32 scale per ``tile`` (1x128 for activations and gradients, 128x128
    for weights)."""
    return _quantize_blocks(x, tile, fp8_dtype, power_of_two=False)


def e8m0_bytes(scale_inv: torch.Tensor) -> torch.Tensor:
    """MXFP8 scales as their E8M0 encoding (biased exponent bytes, ``uint8``)."""
    return (torch.log2(scale_inv).round() + _E8M0_BIAS).to(torch.uint8)


def scaled_matmul(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` for two quantised operands ``[m, k]`` and ``[n, k]`` (k the contraction dimension), in
    ``out_dtype``.

    On a CUDA device with FP8 tensor cores, per-tensor scaled operands go through ``torch._scaled_mm``; everywhere
    else (and for block scales) the operands are dequantised to float32 and multiplied there, which is exact for
    the products (FP8 times a scale fits float32) and accumulates in float32 as the tensor cores do.
    """
    if _use_scaled_mm(a, b):
        return torch._scaled_mm(
            a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype, use_fast_accum=False
        )
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def _use_scaled_mm(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    if not (a.data.is_cuda and a.block is None and b.block is None):
        return False
    if a.data.dtype == E5M2 and b.data.dtype == E5M2:
        return False
    # cuBLASLt's FP8 GEMM: compute capability 8.9 or newer, every dimension a multiple of 16, and a row-major
    # first operand (the second is used transposed, so it must be row-major too).
    (m, k), n = a.data.shape, b.data.shape[0]
    if m % 16 or k % 16 or n % 16 or not (a.data.is_contiguous() and b.data.is_contiguous()):
        return False
    return torch.cuda.get_device_capability(a.data.device) >= (8, 9)
