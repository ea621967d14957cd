"""Triton kernels for rotary position embeddings (non-interleaved pairing), forward and backward.

``t`` is viewed as rows of one head's channels; row ``r`` belongs to position ``r // rows_per_position``. The first
``rot_dim`` channels are rotated (channel ``i`` paired with ``i + rot_dim / 2``), the rest are copied through.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rope(
    t_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    head_dim,
    rot_half,
    rows_per_position,
    BACKWARD: tl.constexpr,
    BLOCK_ROT: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = row // rows_per_position
    cols = tl.arange(0, BLOCK_ROT)
    mask = cols < rot_half
    base = row * head_dim
    x1 = tl.load(t_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(t_ptr + base + rot_half + cols, mask=mask, other=0.0).to(tl.float32)
    angles = pos * 2 * rot_half
    cos1 = tl.load(cos_ptr + angles + cols, mask=mask, other=0.0)
    cos2 = tl.load(cos_ptr + angles + rot_half + cols, mask=mask, other=0.0)
    sin1 = tl.load(sin_ptr + angles + cols, mask=mask, other=0.0)
    sin2 = tl.load(sin_ptr + angles + rot_half + cols, mask=mask, other=0.0)
    if BACKWARD:  # the transpose of the rotation: x is the output gradient
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    tl.store(out_ptr + base + cols, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + rot_half + cols, y2.to(out_ptr.dtype.element_ty), mask=mask)
    pass_cols = 2 * rot_half + tl.arange(0, BLOCK_PASS)
    pass_mask = pass_cols < head_dim
    rest = tl.load(t_ptr + base + pass_cols, mask=pass_mask, other=0.0)
    tl.store(out_ptr + base + pass_cols, rest.to(out_ptr.dtype.element_ty), mask=pass_mask)


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """Rotate contiguous ``t`` ``[positions, ..., head_dim]`` by fp32 ``cos`` / ``sin`` ``[positions, rot_dim]``
    (``backward``: apply the transposed rotation, mapping an output gradient to the input gradient)."""
    out = torch.empty_like(t)
    head_dim, rot_dim = t.shape[-1], cos.shape[-1]
    rows = t.numel() // head_dim
    rows_per_position = rows // t.shape[0]
    block_rot = triton.next_power_of_2(max(rot_dim // 2, 1))
    block_pass = triton.next_power_of_2(max(head_dim - rot_dim, 1))
    _rope[(rows,)](
        t,
        cos,
        sin,
        out,
        head_dim,
        rot_dim // 2,
        rows_per_position,
        backward,
        BLOCK_ROT=block_rot,
        BLOCK_PASS=block_pass,
    )
    return out


_TYPES = {"t_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16"}
AOT_SIGNATURES = [
    (
        _rope,
        _TYPES
        | {"head_dim": "i32", "rot_half": "i32", "rows_per_position": "i32"}
        | {"BACKWARD": "constexpr", "BLOCK_ROT": "constexpr", "BLOCK_PASS": "constexpr"},
        {"BACKWARD": backward, "BLOCK_ROT": 64, "BLOCK_PASS": 1},
    )
    for backward in (False, True)
]
