"""Triton kernel for the weight-gradient GEMM accumulated into ``main_grad``: ``main_grad += grad_output^T @ input``.

The semantics of apex's ``fused_weight_gradient_mlp_cuda`` that Megatron calls (``wgrad_gemm_accum_fp32`` /
``wgrad_gemm_accum_fp16``): ``grad_output`` ``[tokens, out]`` and ``input`` ``[tokens, in]`` in fp32, bf16 or fp16;
the products are summed in fp32 and added to the ``[out, in]`` ``main_grad`` tile read in fp32, then stored once in
``main_grad``'s dtype (fp32, or bf16 / fp16). No ``[out, in]`` temporary is ever allocated.

One program owns one ``[BLOCK_N, BLOCK_K]`` tile of ``main_grad`` and walks the token axis, so every element of
``main_grad`` is read and written exactly once and the result is deterministic.
"""

import torch
import triton
import triton.language as tl

# Tile sizes: 128 x 128 output tiles, 32 tokens per step (tl.dot needs every side >= 16).
_BLOCK_N, _BLOCK_K, _BLOCK_T = 128, 128, 32


@triton.jit
def _wgrad_accum(
    go_ptr,
    x_ptr,
    mg_ptr,
    n_tokens,
    n_out,
    n_in,
    stride_go_t,
    stride_go_n,
    stride_x_t,
    stride_x_k,
    stride_mg_n,
    stride_mg_k,
    FP32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    steps = tl.arange(0, BLOCK_T)
    row_mask, col_mask = rows < n_out, cols < n_in
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t0 in range(0, n_tokens, BLOCK_T):
        t = (t0 + steps).to(tl.int64)
        t_mask = t < n_tokens
        # grad_output read transposed, [BLOCK_N, BLOCK_T]: no transposed copy is made.
        go = tl.load(
            go_ptr + rows[:, None].to(tl.int64) * stride_go_n + t[None, :] * stride_go_t,
            mask=row_mask[:, None] & t_mask[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + t[:, None] * stride_x_t + cols[None, :] * stride_x_k,
            mask=t_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if FP32_DOT:
            # fp32 inputs: full fp32 products, as a cuBLAS fp32 GEMM without TF32 computes them. (Also bf16 / fp16
            # tiles in Triton 3.9's interpreter, which multiplies them wrongly; upcasting bf16 values is exact.)
            acc = tl.dot(go.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(go, x, acc)
    mg_offsets = rows[:, None].to(tl.int64) * stride_mg_n + cols[None, :] * stride_mg_k
    tile_mask = row_mask[:, None] & col_mask[None, :]
    total = acc + tl.load(mg_ptr + mg_offsets, mask=tile_mask, other=0.0).to(tl.float32)
    tl.store(mg_ptr + mg_offsets, total.to(mg_ptr.dtype.element_ty), mask=tile_mask)


def wgrad_accumulate(grad_output: torch.Tensor, input: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output.T @ input`` in place, for 2-D ``grad_output`` ``[t, n]`` and ``input`` ``[t, k]``
    of one dtype (fp32 / bf16 / fp16) and ``main_grad`` ``[n, k]`` (fp32 / bf16 / fp16)."""
    n_tokens, n_out = grad_output.shape
    n_in = input.shape[1]
    grid = (triton.cdiv(n_out, _BLOCK_N), triton.cdiv(n_in, _BLOCK_K))
    _wgrad_accum[grid](
        grad_output,
        input,
        main_grad,
        n_tokens,
        n_out,
        n_in,
        *grad_output.stride(),
        *input.stride(),
        *main_grad.stride(),
        FP32_DOT=grad_output.dtype == torch.float32 or grad_output.device.type != "cuda",
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        BLOCK_T=_BLOCK_T,
        num_warps=8,
        num_stages=3,
    )


_SCALARS = {name: "i32" for name in ("n_tokens", "n_out", "n_in")} | {
    name: "i64" for name in ("stride_go_t", "stride_go_n", "stride_x_t", "stride_x_k", "stride_mg_n", "stride_mg_k")
}
_CONSTS = {"BLOCK_N": _BLOCK_N, "BLOCK_K": _BLOCK_K, "BLOCK_T": _BLOCK_T}
AOT_SIGNATURES = [
    (
        _wgrad_accum,
        {"go_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", "mg_ptr": f"*{main}"}
        | _SCALARS
        | {"FP32_DOT": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "BLOCK_T": "constexpr"},
        {"FP32_DOT": dtype == "fp32", **_CONSTS},
    )
    for dtype, main in (("bf16", "fp32"), ("fp32", "fp32"), ("bf16", "bf16"))
]
