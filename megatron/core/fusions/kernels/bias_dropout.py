"""Triton kernels for ``residual + dropout(x + bias)``, forward and backward, with the dropout mask drawn in-kernel.

The mask is never stored: element ``i`` keeps its value when Philox at ``(seed, counter)`` gives a uniform number
``>= p``, and backward draws the same numbers again. The counters follow PyTorch's own Philox accounting (4 numbers
per counter, counter = offset / 4 + i / 4, component i % 4), so a kernel that advances the CUDA generator's offset by
the element count never reuses numbers another PyTorch random op draws from the same generator state.
"""

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _keep(seed, offset, idx, p):
    counter = offset // 4 + idx // 4
    r0, r1, r2, r3 = tl.rand4x(seed, counter)
    lane = idx % 4
    r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return r >= p


@triton.jit
def _bda_fwd(
    x_ptr,
    bias_ptr,
    residual_ptr,
    out_ptr,
    n_elements,
    n_cols,
    p,
    keep_scale,
    seed,
    offset,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = idx < n_elements
    x = tl.load(x_ptr + idx, mask=in_range, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + idx % n_cols, mask=in_range, other=0.0).to(tl.float32)
    if DROPOUT:
        x = tl.where(_keep(seed, offset, idx, p), x * keep_scale, 0.0)
    residual = tl.load(residual_ptr + idx, mask=in_range, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, (residual + x).to(out_ptr.dtype.element_ty), mask=in_range)


@triton.jit
def _bda_bwd(g_ptr, dx_ptr, n_elements, p, keep_scale, seed, offset, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = idx < n_elements
    g = tl.load(g_ptr + idx, mask=in_range, other=0.0).to(tl.float32)
    dx = tl.where(_keep(seed, offset, idx, p), g * keep_scale, 0.0)
    tl.store(dx_ptr + idx, dx.to(dx_ptr.dtype.element_ty), mask=in_range)


def _keep_scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)  # p = 1 keeps nothing (uniform numbers are < 1)


def _grid(n: int):
    return (triton.cdiv(n, _BLOCK),)


def bias_dropout_add_forward(x, bias, residual, p: float, seed: int, offset: int) -> torch.Tensor:
    """``residual + dropout(x + bias)`` for contiguous ``x`` and ``residual`` of one shape (``bias``: the last axis,
    or None; ``p == 0``: no dropout), in ``residual``'s dtype."""
    out = torch.empty_like(residual)
    n, cols = x.numel(), x.shape[-1]
    _bda_fwd[_grid(n)](
        x, bias if bias is not None else x, residual, out, n, cols, p, _keep_scale(p), seed, offset,
        bias is not None, p > 0.0, BLOCK=_BLOCK,
    )  # fmt: skip
    return out


def dropout_backward(g: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
    """The gradient of ``bias_dropout_add_forward`` with respect to ``x + bias`` (contiguous ``g``), from the same
    draws, in ``g``'s dtype."""
    dx = torch.empty_like(g)
    n = g.numel()
    _bda_bwd[_grid(n)](g, dx, n, p, _keep_scale(p), seed, offset, BLOCK=_BLOCK)
    return dx


_RNG = {"p": "fp32", "keep_scale": "fp32", "seed": "i64", "offset": "i64"}
AOT_SIGNATURES = [
    (
        _bda_fwd,
        {"x_ptr": "*bf16", "bias_ptr": "*bf16", "residual_ptr": "*bf16", "out_ptr": "*bf16"}
        | {"n_elements": "i64", "n_cols": "i32", **_RNG, "HAS_BIAS": "constexpr", "DROPOUT": "constexpr"}
        | {"BLOCK": "constexpr"},
        {"HAS_BIAS": True, "DROPOUT": True, "BLOCK": _BLOCK},
    ),
    (
        _bda_bwd,
        {"g_ptr": "*bf16", "dx_ptr": "*bf16", "n_elements": "i64", **_RNG, "BLOCK": "constexpr"},
        {"BLOCK": _BLOCK},
    ),
]
