"""Triton kernels of the flash attention in :mod:`megatron.core.fusions.fused_flash_attention` (forward, and the two
backward passes: one program per key block for dK/dV, one per query block for dQ), and their autograd wrapper.

Imported only when the kernel runs (Triton costs a tenth of a second to import).
"""

from typing import Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton 3.9's interpreter multiplies bf16 tiles wrongly; it gets them as fp32 (values already rounded to bf16).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _capped(s, SOFTCAP: tl.constexpr):
    # softcap * tanh(s / softcap); tanh(x) = 1 - 2 / (exp(2x) + 1) saturates cleanly at +-1
    return SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))


@triton.jit
def _visible(offs_m, offs_n, q_offset, SQ, SK, LEFT: tl.constexpr, RIGHT: tl.constexpr):
    distance = offs_n[None, :] - (offs_m[:, None] + q_offset)
    keep = (offs_m[:, None] < SQ) & (offs_n[None, :] < SK)
    if LEFT >= 0:
        keep = keep & (distance >= -LEFT)
    if RIGHT >= 0:
        keep = keep & (distance <= RIGHT)
    return keep


@triton.jit
def _key_range(m_start, q_offset, SK, BLOCK_M: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr):
    lo = 0
    hi = SK
    if LEFT >= 0:
        lo = tl.maximum(m_start + q_offset - LEFT, 0)
    if RIGHT >= 0:
        hi = tl.minimum(m_start + BLOCK_M + q_offset + RIGHT, SK)
    return lo, hi


@triton.jit
def _forward_kernel(
    Q, K, V, OUT, LSE, scale, q_offset, SQ, SK,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_lb, stride_lh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    m_start = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1)
    head = tl.program_id(2)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = batch * stride_qb + head * stride_qh
    kv_base = batch * stride_kb + (head // GROUP) * stride_kh
    row_ok = offs_m[:, None] < SQ
    q = tl.load(Q + q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_ok & (offs_d[None, :] < D))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(m_start, q_offset, SK, BLOCK_M, LEFT, RIGHT)
    for n_start in range(lo, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n[:, None] < SK) & (offs_d[None, :] < D)
        k = tl.load(K + kv_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_ok)
        v = tl.load(V + kv_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_ok)
        s = _mm(q, tl.trans(k), PRECISION, UPCAST) * scale
        if SOFTCAP > 0:
            s = _capped(s, SOFTCAP)
        s = tl.where(_visible(offs_m, offs_n, q_offset, SQ, SK, LEFT, RIGHT), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_mask = row_ok & (offs_d[None, :] < D)
    tl.store(OUT + q_base + offs_m[:, None] * stride_qs + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=o_mask)
    tl.store(LSE + batch * stride_lb + head * stride_lh + offs_m, lse, mask=offs_m < SQ)


@triton.jit
def _probs_and_dscores(
    q, k, v, do, lse, delta, offs_m, offs_n, q_offset, SQ, SK, scale,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """The block's probabilities ``p`` and the gradient of its raw (pre-cap, scaled) scores."""
    s = _mm(q, tl.trans(k), PRECISION, UPCAST) * scale
    if SOFTCAP > 0:
        s = _capped(s, SOFTCAP)
    visible = _visible(offs_m, offs_n, q_offset, SQ, SK, LEFT, RIGHT)
    p = tl.where(visible, tl.exp(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None]), 0.0)
    dp = _mm(do, tl.trans(v), PRECISION, UPCAST)
    ds = p * (dp - delta[:, None])
    if SOFTCAP > 0:
        t = s / SOFTCAP
        ds = ds * (1.0 - t * t)
    return p, ds


@triton.jit
def _backward_kv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, scale, q_offset, SQ, SK,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_lb, stride_lh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block, summed over the query heads of its group (no atomics)."""
    n_start = tl.program_id(0) * BLOCK_N
    batch = tl.program_id(1)
    group = tl.program_id(2)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_base = batch * stride_kb + group * stride_kh
    kv_ok = (offs_n[:, None] < SK) & (offs_d[None, :] < D)
    k = tl.load(K + kv_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_ok)
    v = tl.load(V + kv_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_ok)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Queries at positions p see key j when -LEFT <= j - p <= RIGHT.
    lo = 0
    hi = SQ
    if RIGHT >= 0:
        lo = tl.maximum(n_start - RIGHT - q_offset, 0)
    if LEFT >= 0:
        hi = tl.minimum(n_start + BLOCK_N + LEFT - q_offset, SQ)
    for member in range(GROUP):
        head = group * GROUP + member
        q_base = batch * stride_qb + head * stride_qh
        for m_start in range(lo, hi, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            q_ok = (offs_m[:, None] < SQ) & (offs_d[None, :] < D)
            q = tl.load(Q + q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_ok)
            do = tl.load(DO + q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_ok)
            row = batch * stride_lb + head * stride_lh + offs_m
            lse = tl.load(LSE + row, mask=offs_m < SQ, other=0.0)
            delta = tl.load(DELTA + row, mask=offs_m < SQ, other=0.0)
            p, ds = _probs_and_dscores(
                q,
                k,
                v,
                do,
                lse,
                delta,
                offs_m,
                offs_n,
                q_offset,
                SQ,
                SK,
                scale,
                LEFT,
                RIGHT,
                SOFTCAP,
                PRECISION,
                UPCAST,
            )
            dv += _mm(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
            dk += _mm(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    out_ptr = kv_base + offs_n[:, None] * stride_ks + offs_d[None, :]
    tl.store(DK + out_ptr, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + out_ptr, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _backward_q_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, scale, q_offset, SQ, SK,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_lb, stride_lh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    m_start = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1)
    head = tl.program_id(2)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = batch * stride_qb + head * stride_qh
    kv_base = batch * stride_kb + (head // GROUP) * stride_kh
    q_ok = (offs_m[:, None] < SQ) & (offs_d[None, :] < D)
    q = tl.load(Q + q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_ok)
    do = tl.load(DO + q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_ok)
    row = batch * stride_lb + head * stride_lh + offs_m
    lse = tl.load(LSE + row, mask=offs_m < SQ, other=0.0)
    delta = tl.load(DELTA + row, mask=offs_m < SQ, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(m_start, q_offset, SK, BLOCK_M, LEFT, RIGHT)
    for n_start in range(lo, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n[:, None] < SK) & (offs_d[None, :] < D)
        k = tl.load(K + kv_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_ok)
        v = tl.load(V + kv_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_ok)
        _, ds = _probs_and_dscores(
            q,
            k,
            v,
            do,
            lse,
            delta,
            offs_m,
            offs_n,
            q_offset,
            SQ,
            SK,
            scale,
            LEFT,
            RIGHT,
            SOFTCAP,
            PRECISION,
            UPCAST,
        )
        dq += _mm(ds.to(k.dtype), k, PRECISION, UPCAST)
    tl.store(
        DQ + q_base + offs_m[:, None] * stride_qs + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=q_ok
    )


def _launch_settings(q: torch.Tensor, k: torch.Tensor, window: Tuple[int, int], softcap: float) -> dict:
    interpreted = q.device.type != "cuda"
    block = 16 if interpreted else 64  # tiny blocks keep the interpreter fast; 64 x 64 tiles on a GPU
    return dict(
        GROUP=q.shape[1] // k.shape[1],
        D=q.shape[-1],
        BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])),
        BLOCK_M=block,
        BLOCK_N=block,
        LEFT=int(window[0]),
        RIGHT=int(window[1]),
        SOFTCAP=float(softcap),
        # fp32 inputs keep fp32 products (no TF32), so the kernel matches the eager reference to rounding.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreted and q.dtype == torch.bfloat16,
    )


def _strides(q, k, lse):
    return (*q.stride()[:3], *k.stride()[:3], *lse.stride()[:2])


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton kernels; returns ``(out, lse)`` (``lse`` carries no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale: float, window: Tuple[int, int], softcap: float, q_offset: int):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, heads, sq, _ = q.shape
        sk = k.shape[2]
        out = torch.empty_like(q)
        lse = torch.empty(b, heads, sq, dtype=torch.float32, device=q.device)
        meta = _launch_settings(q, k, window, softcap)
        grid = (triton.cdiv(sq, meta["BLOCK_M"]), b, heads)
        _forward_kernel[grid](
            q, k, v, out, lse, softmax_scale, q_offset, sq, sk, *_strides(q, k, lse), **meta
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (softmax_scale, window, softcap, q_offset)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        softmax_scale, window, softcap, q_offset = ctx.settings
        dout = dout.contiguous()
        b, heads, sq, _ = q.shape
        sk = k.shape[2]
        delta = (dout.float() * out.float()).sum(-1)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        meta = _launch_settings(q, k, window, softcap)
        strides = _strides(q, k, lse)
        _backward_kv_kernel[(triton.cdiv(sk, meta["BLOCK_N"]), b, k.shape[1])](
            q, k, v, dout, lse, delta, dk, dv, softmax_scale, q_offset, sq, sk, *strides, **meta
        )  # fmt: skip
        _backward_q_kernel[(triton.cdiv(sq, meta["BLOCK_M"]), b, heads)](
            q, k, v, dout, lse, delta, dq, softmax_scale, q_offset, sq, sk, *strides, **meta
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None
