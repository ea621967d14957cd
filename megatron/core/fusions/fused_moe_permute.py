"""MoE token permutation as fused autograd functions (``--moe-permute-fusion``, config ``moe_permute_fusion``).

``moe_utils.permute(..., fused=True)`` / ``unpermute(..., fused=True)`` run these where our Triton kernels can
(CUDA with Triton; CPU under ``TRITON_INTERPRET=1`` for the tests); everywhere else the PyTorch code in ``moe_utils``
runs and computes the same rows. As with Transformer Engine's ``moe_permute`` in Megatron, the fused permute returns
a row map in place of the sorted token indices, and only the fused unpermute reads it:

``row_id_map [tokens, experts]`` (int32) holds the permuted row of each (token, expert) entry, -1 where the entry
has none. Rows are laid out as the PyTorch code lays them out: expert-major, each expert's tokens in token order,
cut at ``num_out_tokens``; with ``drop_and_pad`` every expert gets ``capacity = num_out_tokens // experts`` rows,
filled after its routed tokens by its unrouted ones in token order (PyTorch's stable descending argsort does the
same). The map is two cumulative sums over the routing map; the kernels then move each token's row once per entry,
forward and backward, without atomics.
"""

import torch

from megatron.core.fusions.kernel_dispatch import use_triton

FUSION, FLAG = "moe_permute_fusion", "no --moe-permute-fusion"


def permute_kernel_available(tokens: torch.Tensor) -> bool:
    """Whether the fused permute runs our kernel for ``tokens`` (else moe_utils' PyTorch code runs)."""
    return use_triton(tokens, FUSION, FLAG)


def _stable_rank(mask: torch.Tensor) -> torch.Tensor:
    """Position of each entry along the last axis once the True entries are moved first, order kept within each
    kind (what a stable descending argsort of the 0/1 values gives)."""
    ones = mask.to(torch.int32).cumsum(-1)
    zeros = (~mask).to(torch.int32).cumsum(-1)
    return torch.where(mask, ones - 1, ones[..., -1:] + zeros - 1)


def make_row_id_map(routing_map: torch.Tensor, num_out_tokens: int, drop_and_pad: bool) -> torch.Tensor:
    """``[tokens, experts]`` int32: the permuted row of each entry of ``routing_map``, -1 where there is none."""
    num_tokens, num_experts = routing_map.shape
    by_expert = routing_map.bool().T
    if drop_and_pad:
        capacity = min(num_out_tokens // num_experts, num_tokens)
        rank = _stable_rank(by_expert)
        first_row = torch.arange(num_experts, device=routing_map.device, dtype=torch.int32).unsqueeze(-1) * capacity
        rows = torch.where(rank < capacity, first_row + rank, -1)
    else:
        rank = _stable_rank(by_expert.reshape(-1)).view(num_experts, num_tokens)
        rows = torch.where(rank < num_out_tokens, rank, -1)
    return rows.T.contiguous().to(torch.int32)


class _FusedPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, probs, row_id_map, num_rows):
        from megatron.core.fusions.kernels import moe_permute as kernels

        permuted, permuted_probs = kernels.scatter_rows(
            tokens.contiguous(), row_id_map, num_rows, probs=None if probs is None else probs.contiguous()
        )
        ctx.save_for_backward(row_id_map)
        ctx.probs_dtype = None if probs is None else probs.dtype
        return permuted, permuted_probs

    @staticmethod
    def backward(ctx, grad_permuted, grad_permuted_probs):
        from megatron.core.fusions.kernels import moe_permute as kernels

        (row_id_map,) = ctx.saved_tensors
        if ctx.probs_dtype is not None and grad_permuted_probs is None:
            grad_permuted_probs = torch.zeros(grad_permuted.shape[0], dtype=ctx.probs_dtype, device=row_id_map.device)
        pgrad = None if ctx.probs_dtype is None else grad_permuted_probs.contiguous()
        grad_tokens, grad_probs = kernels.gather_rows(
            grad_permuted.contiguous(), row_id_map, permuted_probs_grad=pgrad, probs_dtype=ctx.probs_dtype
        )
        return grad_tokens, grad_probs, None, None


class _FusedUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, row_id_map, probs):
        from megatron.core.fusions.kernels import moe_permute as kernels

        permuted = permuted.contiguous()
        probs = None if probs is None else probs.contiguous()
        output, _ = kernels.gather_rows(permuted, row_id_map, weight=probs)
        # The permuted rows are needed only for the probabilities' gradient: not kept without probabilities.
        ctx.save_for_backward(None if probs is None else permuted, row_id_map, probs)
        ctx.num_rows = permuted.shape[0]
        return output

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.fusions.kernels import moe_permute as kernels

        permuted, row_id_map, probs = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_permuted, _ = kernels.scatter_rows(grad_output, row_id_map, ctx.num_rows, weight=probs)
        grad_probs = None
        if probs is not None and ctx.needs_input_grad[2]:
            grad_probs = kernels.merging_probs_grad(grad_output, permuted, row_id_map, probs.dtype)
        return grad_permuted, None, grad_probs


def fused_permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):
    """``(permuted tokens, permuted probs or None, row_id_map)`` for ``tokens`` ``[tokens, hidden]`` and the bool
    ``routing_map`` / ``probs`` ``[tokens, experts]``; the rows are those of ``moe_utils.permute``."""
    if num_out_tokens is None:
        num_out_tokens = int(routing_map.sum())
    row_id_map = make_row_id_map(routing_map, num_out_tokens, drop_and_pad)
    num_experts = routing_map.shape[1]
    num_rows = num_experts * min(num_out_tokens // num_experts, tokens.shape[0]) if drop_and_pad else num_out_tokens
    permuted, permuted_probs = _FusedPermute.apply(tokens, probs, row_id_map, num_rows)
    return permuted, permuted_probs, row_id_map


def fused_unpermute(permuted_tokens, row_id_map, probs=None):
    """Each token's permuted rows (times its ``probs`` ``[tokens, experts]`` when given) summed back into its row:
    ``[tokens, hidden]`` in ``permuted_tokens``' dtype, accumulated in fp32."""
    return _FusedUnpermute.apply(permuted_tokens, row_id_map, probs)
