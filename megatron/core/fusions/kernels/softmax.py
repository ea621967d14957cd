"""Triton kernels for the scaled, masked softmax of attention scores, forward and backward.

Forward: one program per row of ``[batch, heads, sq, sk]`` scores (the row held in registers): scale, hide the
masked keys (the causal upper triangle, or a boolean mask broadcast over batch and heads through its strides, never
materialised), softmax in fp32, one rounding when storing. A row with every key hidden gives zeros. Backward from
the saved probabilities: ``dx = scale * y * (dy - sum(dy * y))``, zero wherever ``y`` is.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_fwd(
    x_ptr,
    mask_ptr,
    y_ptr,
    scale,
    n_cols,
    n_q,
    n_heads,
    mask_stride_b,
    mask_stride_h,
    mask_stride_q,
    mask_stride_k,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=in_row, other=0.0).to(tl.float32) * scale
    hidden = cols >= n_cols
    q = row % n_q
    if CAUSAL:
        hidden = hidden | (cols > q)
    if HAS_MASK:
        head = (row // n_q) % n_heads
        batch = row // (n_q * n_heads)
        base = batch * mask_stride_b + head * mask_stride_h + q * mask_stride_q
        masked = tl.load(mask_ptr + base + cols * mask_stride_k, mask=in_row, other=1)
        hidden = hidden | (masked != 0)
    x = tl.where(hidden, float("-inf"), x)
    # A fully hidden row has max -inf: shift by 0 there so no inf - inf appears, and store zeros.
    row_max = tl.max(x, axis=0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    e = tl.where(hidden, 0.0, tl.exp(x - row_max))
    total = tl.sum(e, axis=0)
    y = e / tl.where(total > 0.0, total, 1.0)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _softmax_bwd(dy_ptr, y_ptr, dx_ptr, scale, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < n_cols
    dy = tl.load(dy_ptr + row * n_cols + cols, mask=in_row, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * n_cols + cols, mask=in_row, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(dy * y, axis=0))
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)


def _launch_options(n_cols: int) -> dict:
    block = triton.next_power_of_2(n_cols)
    return {"BLOCK": block, "num_warps": min(16, max(1, block // 256))}


def softmax_forward(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    """Probabilities for contiguous ``x`` ``[batch, heads, sq, sk]``: ``softmax(x * scale)`` over keys that are not
    hidden (``causal``: keys after the query; ``mask``: True = hidden, broadcastable to ``x``)."""
    batch, heads, sq, sk = x.shape
    y = torch.empty_like(x)
    if mask is not None:
        # Same-size view as bytes: the kernel reads 0 / 1 through the (possibly zero) strides of the broadcast.
        mask = mask.expand(batch, heads, sq, sk).view(torch.uint8)
        strides = mask.stride()
    else:
        strides = (0, 0, 0, 0)
    rows = batch * heads * sq
    _softmax_fwd[(rows,)](
        x,
        mask if mask is not None else x,
        y,
        scale,
        sk,
        sq,
        heads,
        *strides,
        causal,
        mask is not None,
        **_launch_options(sk),
    )
    return y


def softmax_backward(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """The gradient of ``softmax_forward`` with respect to its input, from its output ``y`` (both contiguous)."""
    dx = torch.empty_like(y)
    sk = y.shape[-1]
    _softmax_bwd[(y.numel() // sk,)](dy, y, dx, scale, sk, **_launch_options(sk))
    return dx


_FWD_TYPES = {"x_ptr": "*bf16", "mask_ptr": "*u8", "y_ptr": "*bf16", "scale": "fp32", "n_cols": "i32", "n_q": "i32"}
_MASK_STRIDES = {f"mask_stride_{axis}": "i32" for axis in "bhqk"}
AOT_SIGNATURES = [
    (
        _softmax_fwd,
        {**_FWD_TYPES, "n_heads": "i32", **_MASK_STRIDES, "CAUSAL": "constexpr", "HAS_MASK": "constexpr"}
        | {"BLOCK": "constexpr"},
        {"CAUSAL": causal, "HAS_MASK": not causal, "BLOCK": 1024},
    )
    for causal in (True, False)
] + [
    (
        _softmax_bwd,
        {"dy_ptr": "*bf16", "y_ptr": "*bf16", "dx_ptr": "*bf16", "scale": "fp32", "n_cols": "i32"}
        | {"BLOCK": "constexpr"},
        {"BLOCK": 1024},
    )
]
