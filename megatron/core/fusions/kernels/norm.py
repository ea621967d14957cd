"""Triton kernels for LayerNorm and RMSNorm over the last axis, forward and backward.

Forward: one program per row, statistics in fp32, saving each row's mean and 1/std for backward. Backward: each
program walks a contiguous run of rows, writes their input gradient and accumulates its share of the weight (and
bias) gradients in fp32; the shares are summed on the host (one small reduction).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, IS_RMS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if not IS_RMS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _norm_bwd(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_ptr,
    db_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    IS_RMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = (first + i).to(tl.int64)
        if row < n_rows:
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / n_cols
            if IS_RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                c2 = tl.sum(wdy, axis=0) / n_cols
                dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)
    if not IS_RMS:
        tl.store(db_ptr + pid * n_cols + cols, db, mask=mask)


def _block(n_cols: int) -> int:
    return triton.next_power_of_2(n_cols)


def norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, is_rms: bool):
    """``(y, mean, rstd)`` for a 2-D contiguous ``x``; ``mean`` and ``rstd`` are fp32 per row (mean is 0 for RMS)."""
    rows, cols = x.shape
    y = torch.empty_like(x)
    # RMSNorm subtracts no mean: its row means stay zero for the shared backward.
    mean = (torch.zeros if is_rms else torch.empty)(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else weight
    _norm_fwd[(rows,)](x, weight, b, y, mean, rstd, cols, eps, is_rms, BLOCK=_block(cols))
    return y, mean, rstd


def norm_backward(dy, x, weight, mean, rstd, is_rms: bool, programs: int = 256):
    """``(dx, dweight, dbias)`` (dbias None for RMS) for the forward above; ``programs`` bounds the partial sums."""
    rows, cols = x.shape
    programs = max(1, min(programs, rows))
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    dx = torch.empty_like(x)
    dw = torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    db = torch.empty((programs, cols), dtype=torch.float32, device=x.device) if not is_rms else dw
    _norm_bwd[(programs,)](
        dy, x, weight, mean, rstd, dx, dw, db, rows, cols, rows_per_program, is_rms, BLOCK=_block(cols)
    )
    dbias = None if is_rms else db.sum(0).to(weight.dtype)
    return dx, dw.sum(0).to(weight.dtype), dbias


_FWD_TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "mean_ptr": "*fp32"}
_BWD_TYPES = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "mean_ptr": "*fp32", "rstd_ptr": "*fp32"}
AOT_SIGNATURES = [
    (
        _norm_fwd,
        {**_FWD_TYPES, "rstd_ptr": "*fp32", "n_cols": "i32", "eps": "fp32"}
        | {"IS_RMS": "constexpr", "BLOCK": "constexpr"},
        {"IS_RMS": is_rms, "BLOCK": 1024},
    )
    for is_rms in (False, True)
] + [
    (
        _norm_bwd,
        {
            **_BWD_TYPES,
            **{"dx_ptr": "*bf16", "dw_ptr": "*fp32", "db_ptr": "*fp32"},
            **{"n_rows": "i32", "n_cols": "i32", "rows_per_program": "i32"},
            **{"IS_RMS": "constexpr", "BLOCK": "constexpr"},
        },
        {"IS_RMS": is_rms, "BLOCK": 1024},
    )
    for is_rms in (False, True)
]
