"""Triton kernels for the vocab-parallel cross entropy, forward statistics and backward, without a softmax tensor.

Forward walks each row of this rank's logit slice once (online maximum and sum of exponentials) and picks the
target's logit where this rank owns it; the caller reduces the three per-row numbers over the tensor-parallel group.
Backward recomputes ``softmax - one_hot(target)`` from the logits and the reduced statistics, scaled by the
incoming gradient, so nothing of size ``[tokens, vocab]`` is stored besides the logits themselves.
"""

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _ce_fwd(logits_ptr, target_ptr, max_ptr, sum_exp_ptr, target_logit_ptr, n_cols, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * n_cols
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    target = tl.load(target_ptr + row) - vocab_start
    owned = (target >= 0) & (target < n_cols)
    target_logit = tl.load(row_ptr + tl.where(owned, target, 0)).to(tl.float32)
    tl.store(max_ptr + row, running_max)
    tl.store(sum_exp_ptr + row, running_sum)
    tl.store(target_logit_ptr + row, tl.where(owned, target_logit, 0.0))


@triton.jit
def _ce_bwd(
    logits_ptr, target_ptr, max_ptr, sum_exp_ptr, grad_out_ptr, grad_ptr, n_cols, vocab_start, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(logits_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    row_max = tl.load(max_ptr + row)
    sum_exp = tl.load(sum_exp_ptr + row)
    g = tl.load(grad_out_ptr + row)
    target = tl.load(target_ptr + row) - vocab_start
    grad = tl.exp(x - row_max) / sum_exp - tl.where(cols == target, 1.0, 0.0)
    tl.store(grad_ptr + row * n_cols + cols, (grad * g).to(grad_ptr.dtype.element_ty), mask=mask)


def cross_entropy_statistics(logits: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """``(row max, sum of exp(logit - row max), target logit or 0 where not owned)``, fp32, for 2-D ``logits``."""
    rows, cols = logits.shape
    stats = torch.empty((3, rows), dtype=torch.float32, device=logits.device)
    _ce_fwd[(rows,)](logits, target, stats[0], stats[1], stats[2], cols, vocab_start, BLOCK=_BLOCK)
    return stats[0], stats[1], stats[2]


def cross_entropy_backward(logits, target, row_max, sum_exp, grad_output, vocab_start: int) -> torch.Tensor:
    """``grad_output * (softmax(logits) - one_hot(target))`` from the globally reduced ``row_max`` and ``sum_exp``."""
    rows, cols = logits.shape
    grad = torch.empty_like(logits)
    grid = (rows, triton.cdiv(cols, _BLOCK))
    _ce_bwd[grid](logits, target, row_max, sum_exp, grad_output, grad, cols, vocab_start, BLOCK=_BLOCK)
    return grad


_COMMON = {"n_cols": "i32", "vocab_start": "i32", "BLOCK": "constexpr"}
AOT_SIGNATURES = [
    (
        _ce_fwd,
        {"logits_ptr": "*bf16", "target_ptr": "*i64", "max_ptr": "*fp32", "sum_exp_ptr": "*fp32"}
        | {"target_logit_ptr": "*fp32"}
        | _COMMON,
        {"BLOCK": _BLOCK},
    ),
    (
        _ce_bwd,
        {"logits_ptr": "*bf16", "target_ptr": "*i64", "max_ptr": "*fp32", "sum_exp_ptr": "*fp32"}
        | {"grad_out_ptr": "*fp32", "grad_ptr": "*bf16"}
        | _COMMON,
        {"BLOCK": _BLOCK},
    ),
]
