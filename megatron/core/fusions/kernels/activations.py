"""Triton kernels for bias + SwiGLU and bias + GeLU (tanh approximation), forward and backward.

Inputs are 2-D and contiguous (``[tokens, features]``); the math is done in fp32 and stored in the input's dtype.
"""

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # 1 - 2 / (1 + e^{2x}) saturates to +-1 instead of overflowing to nan.
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * x))


@triton.jit
def _swiglu_fwd(y_ptr, bias_ptr, out_ptr, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(y_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b += tl.load(bias_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = a * _sigmoid(a) * b
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(g_ptr, y_ptr, bias_ptr, dy_ptr, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(y_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b += tl.load(bias_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    sig = _sigmoid(a)
    da = g * b * sig * (1.0 + a * (1.0 - sig))
    db = g * a * sig
    tl.store(dy_ptr + row * 2 * n_cols + cols, da.to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dy_ptr + row * 2 * n_cols + n_cols + cols, db.to(dy_ptr.dtype.element_ty), mask=mask)


# GeLU's tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). The constants are written out in the
# kernels: a global would have to be a tl.constexpr, which Triton's interpreter does not multiply with tensors.


@triton.jit
def _gelu_fwd(y_ptr, bias_ptr, out_ptr, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd(g_ptr, y_ptr, bias_ptr, dy_ptr, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x))
    dt = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt
    tl.store(dy_ptr + row * n_cols + cols, (g * grad).to(dy_ptr.dtype.element_ty), mask=mask)


def _grid(rows: int, cols: int):
    return (rows, triton.cdiv(cols, _BLOCK))


def swiglu_forward(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(a) * b`` for ``[a; b] = y + bias`` split on the last axis: ``[n, 2h] -> [n, h]``."""
    rows, half = y.shape[0], y.shape[1] // 2
    out = torch.empty((rows, half), dtype=y.dtype, device=y.device)
    _swiglu_fwd[_grid(rows, half)](y, bias if bias is not None else y, out, half, bias is not None, BLOCK=_BLOCK)
    return out


def swiglu_backward(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The gradient of ``swiglu_forward`` with respect to ``y`` (and, summed over rows, ``bias``)."""
    rows, half = g.shape
    dy = torch.empty_like(y)
    _swiglu_bwd[_grid(rows, half)](g, y, bias if bias is not None else y, dy, half, bias is not None, BLOCK=_BLOCK)
    return dy


def gelu_forward(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GeLU (tanh approximation) of ``y + bias``."""
    out = torch.empty_like(y)
    rows, cols = y.shape
    _gelu_fwd[_grid(rows, cols)](y, bias if bias is not None else y, out, cols, bias is not None, BLOCK=_BLOCK)
    return out


def gelu_backward(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The gradient of ``gelu_forward`` with respect to ``y`` (and, summed over rows, ``bias``)."""
    dy = torch.empty_like(y)
    rows, cols = y.shape
    _gelu_bwd[_grid(rows, cols)](g, y, bias if bias is not None else y, dy, cols, bias is not None, BLOCK=_BLOCK)
    return dy


_SCALARS = {"n_cols": "i32", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"}
AOT_SIGNATURES = [
    (kernel, {**ptrs, **_SCALARS}, {"HAS_BIAS": True, "BLOCK": _BLOCK})
    for kernel, ptrs in (
        (_swiglu_fwd, {"y_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"}),
        (_swiglu_bwd, {"g_ptr": "*bf16", "y_ptr": "*bf16", "bias_ptr": "*bf16", "dy_ptr": "*bf16"}),
        (_gelu_fwd, {"y_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"}),
        (_gelu_bwd, {"g_ptr": "*bf16", "y_ptr": "*bf16", "bias_ptr": "*bf16", "dy_ptr": "*bf16"}),
    )
]
