"""Triton kernels for MoE token permutation (``--moe-permute-fusion``), forward and backward.

Both directions are driven by one row map ``[tokens, experts]`` (int32): the permuted row each (token, expert) entry
goes to, -1 where it goes nowhere. A program owns one token (and one block of hidden channels), so every kernel
writes each output element once: no atomics, and the results do not depend on scheduling.

- ``_scatter_rows``: copy a token's row to each of its permuted rows, optionally scaled by a per-entry weight
  (permute forward; unpermute backward with the merging probabilities), and optionally carry the per-entry
  probabilities to their permuted rows.
- ``_gather_rows``: the weighted sum of a token's permuted rows back into its row (unpermute forward; permute
  backward), optionally gathering the permuted probabilities' gradient back to ``[tokens, experts]``.
- ``_merging_probs_grad``: for unpermute with merging probabilities, the gradient of each probability, the dot
  product of the token's output gradient with its permuted row.
"""

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _scatter_rows(
    src_ptr,
    row_id_ptr,
    weight_ptr,
    dst_ptr,
    probs_ptr,
    probs_out_ptr,
    hidden,
    num_experts,
    HAS_WEIGHT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden
    x = tl.load(src_ptr + token * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
    for expert in range(num_experts):
        entry = token * num_experts + expert
        row = tl.load(row_id_ptr + entry).to(tl.int64)
        if row >= 0:  # a whole-program branch: most entries of a row are not routed and cost one load
            y = x
            if HAS_WEIGHT:
                y = x * tl.load(weight_ptr + entry).to(tl.float32)
            tl.store(dst_ptr + row * hidden + cols, y.to(dst_ptr.dtype.element_ty), mask=in_row)
            if HAS_PROBS:
                prob = tl.load(probs_ptr + entry).to(probs_out_ptr.dtype.element_ty)
                tl.store(probs_out_ptr + row, prob, mask=tl.program_id(1) == 0)


@triton.jit
def _gather_rows(
    src_ptr,
    row_id_ptr,
    weight_ptr,
    dst_ptr,
    probs_grad_ptr,
    probs_grad_out_ptr,
    hidden,
    num_experts,
    HAS_WEIGHT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for expert in range(num_experts):
        entry = token * num_experts + expert
        row = tl.load(row_id_ptr + entry).to(tl.int64)
        if row >= 0:  # a whole-program branch: most entries of a row are not routed and cost one load
            x = tl.load(src_ptr + row * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                x = x * tl.load(weight_ptr + entry).to(tl.float32)
            acc += x
        if HAS_PROBS:  # every entry's gradient is written: zero where it was not routed
            routed = row >= 0
            grad = tl.load(probs_grad_ptr + tl.where(routed, row, 0), mask=routed, other=0.0)
            grad = grad.to(probs_grad_out_ptr.dtype.element_ty)
            tl.store(probs_grad_out_ptr + entry, grad, mask=tl.program_id(1) == 0)
    tl.store(dst_ptr + token * hidden + cols, acc.to(dst_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _merging_probs_grad(grad_ptr, permuted_ptr, row_id_ptr, probs_grad_ptr, hidden, num_experts, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    expert = tl.program_id(1)
    entry = token * num_experts + expert
    row = tl.load(row_id_ptr + entry).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if row >= 0:  # most entries are not routed: skip their pass over the hidden channels
        for start in range(0, hidden, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < hidden
            g = tl.load(grad_ptr + token * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
            x = tl.load(permuted_ptr + row * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
            acc += g * x
    tl.store(probs_grad_ptr + entry, tl.sum(acc, axis=0).to(probs_grad_ptr.dtype.element_ty))


def _grid(tokens: int, hidden: int):
    return (tokens, triton.cdiv(hidden, _BLOCK))


def scatter_rows(src, row_id, num_rows: int, weight=None, probs=None):
    """``(dst [num_rows, hidden], permuted probs [num_rows] or None)``: each token's row (times ``weight[t, e]``)
    copied to row ``row_id[t, e]``; ``probs[t, e]`` carried alongside. Rows no entry maps to are zero."""
    tokens, hidden = src.shape
    num_experts = row_id.shape[1]
    dst = torch.zeros((num_rows, hidden), dtype=src.dtype, device=src.device)
    probs_out = None if probs is None else torch.zeros(num_rows, dtype=probs.dtype, device=src.device)
    _scatter_rows[_grid(tokens, hidden)](
        src,
        row_id,
        src if weight is None else weight,
        dst,
        src if probs is None else probs,
        dst if probs is None else probs_out,
        hidden,
        num_experts,
        weight is not None,
        probs is not None,
        BLOCK=_BLOCK,
    )
    return dst, probs_out


def gather_rows(src, row_id, weight=None, permuted_probs_grad=None, probs_dtype=None):
    """``(dst [tokens, hidden], probs gradient [tokens, experts] or None)``: each token's permuted rows summed back
    (times ``weight[t, e]``), in fp32 and stored in ``src``'s dtype; the permuted probabilities' gradient
    ``permuted_probs_grad`` [rows] returned to the entries it came from (zero elsewhere)."""
    hidden = src.shape[1]
    tokens, num_experts = row_id.shape
    dst = torch.empty((tokens, hidden), dtype=src.dtype, device=src.device)
    probs_grad = None
    if permuted_probs_grad is not None:
        probs_grad = torch.empty((tokens, num_experts), dtype=probs_dtype, device=src.device)
    _gather_rows[_grid(tokens, hidden)](
        src,
        row_id,
        src if weight is None else weight,
        dst,
        src if permuted_probs_grad is None else permuted_probs_grad,
        dst if probs_grad is None else probs_grad,
        hidden,
        num_experts,
        weight is not None,
        permuted_probs_grad is not None,
        BLOCK=_BLOCK,
    )
    return dst, probs_grad


def merging_probs_grad(grad_output, permuted, row_id, probs_dtype):
    """``[tokens, experts]``: ``grad_output[t] . permuted[row_id[t, e]]``, zero where the entry is not routed."""
    tokens, num_experts = row_id.shape
    probs_grad = torch.empty((tokens, num_experts), dtype=probs_dtype, device=grad_output.device)
    _merging_probs_grad[(tokens, num_experts)](
        grad_output, permuted, row_id, probs_grad, grad_output.shape[1], num_experts, BLOCK=_BLOCK
    )
    return probs_grad


_ROWS = {"hidden": "i32", "num_experts": "i32"}
_FLAGS = {"HAS_WEIGHT": "constexpr", "HAS_PROBS": "constexpr", "BLOCK": "constexpr"}
AOT_SIGNATURES = (
    [
        (
            _scatter_rows,
            {"src_ptr": "*bf16", "row_id_ptr": "*i32", "weight_ptr": "*fp32", "dst_ptr": "*bf16"}
            | {"probs_ptr": "*fp32", "probs_out_ptr": "*fp32"}
            | _ROWS
            | _FLAGS,
            {"HAS_WEIGHT": weighted, "HAS_PROBS": not weighted, "BLOCK": _BLOCK},
        )
        for weighted in (False, True)
    ]
    + [
        (
            _gather_rows,
            {"src_ptr": "*bf16", "row_id_ptr": "*i32", "weight_ptr": "*fp32", "dst_ptr": "*bf16"}
            | {"probs_grad_ptr": "*fp32", "probs_grad_out_ptr": "*fp32"}
            | _ROWS
            | _FLAGS,
            {"HAS_WEIGHT": weighted, "HAS_PROBS": not weighted, "BLOCK": _BLOCK},
        )
        for weighted in (False, True)
    ]
    + [
        (
            _merging_probs_grad,
            {"grad_ptr": "*bf16", "permuted_ptr": "*bf16", "row_id_ptr": "*i32", "probs_grad_ptr": "*fp32"}
            | _ROWS
            | {"BLOCK": "constexpr"},
            {"BLOCK": _BLOCK},
        )
    ]
)
