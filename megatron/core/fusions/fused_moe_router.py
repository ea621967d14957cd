"""MoE routing as fused autograd functions (``--moe-router-fusion``, config ``moe_router_fusion``).

``moe_utils.topk_routing_with_score_function(..., fused=True)`` and ``compute_routing_scores_for_aux_loss(...,
fused=True)`` run these where our Triton kernel can (CUDA with Triton; CPU under ``TRITON_INTERPRET=1`` for the
tests): one pass per token row computes the scores, the top k, and the dense probabilities and routing map (or the
aux-loss scores and their map); backward recomputes the scores from the logits and the saved map. Elsewhere, and for
what the kernel does not take (group-limited top-k, dense ``[tokens, topk]`` output, more than
``MAX_EXPERTS`` experts), the PyTorch code in ``moe_utils`` runs (on CUDA with one notice).

Among equal scores the kernel picks the lowest expert index; ``torch.topk`` leaves the order of equal values
unspecified, so the two may choose different (equally scored) experts for a tied row.
"""

import torch

from megatron.core.fusions.kernel_dispatch import fallback_notice, pytorch_instead, use_triton

FUSION, FLAG = "moe_router_fusion", "no --moe-router-fusion"


def router_kernel_available(logits: torch.Tensor, group_topk=None, dense_output: bool = False) -> bool:
    """Whether the fused routing runs our kernel for ``logits`` ``[tokens, experts]`` (else the PyTorch code)."""
    from megatron.core.fusions.kernels.moe_router import MAX_EXPERTS

    if logits.dim() != 2:
        return False
    unsupported = None
    if group_topk:
        unsupported = "group-limited top-k (moe_router_group_topk) has no kernel"
    elif dense_output:
        unsupported = "dense [tokens, topk] routing output has no kernel"
    elif logits.shape[1] > MAX_EXPERTS:
        unsupported = f"more than {MAX_EXPERTS} experts have no kernel"
    if unsupported is None:
        return use_triton(logits, FUSION, FLAG)
    if logits.device.type != "cpu":
        fallback_notice(FUSION, pytorch_instead(unsupported, FLAG))
    return False


class _FusedTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, score_function, pre_softmax, scale, expert_bias, aux):
        from megatron.core.fusions.kernels import moe_router as kernels

        logits = logits.contiguous()
        probs, routing_map = kernels.topk_forward(logits, topk, score_function, pre_softmax, scale, expert_bias, aux)
        ctx.save_for_backward(logits, routing_map)
        ctx.settings = (topk, score_function, pre_softmax, scale, aux)
        ctx.mark_non_differentiable(routing_map)
        return probs, routing_map

    @staticmethod
    def backward(ctx, grad_probs, grad_map):
        from megatron.core.fusions.kernels import moe_router as kernels

        logits, routing_map = ctx.saved_tensors
        grad = kernels.topk_backward(logits, routing_map, grad_probs.contiguous(), *ctx.settings)
        return grad, None, None, None, None, None, None


def fused_topk_with_score_function(logits, topk, use_pre_softmax, scaling_factor, score_function, expert_bias):
    """``(probs, routing_map)`` ``[tokens, experts]`` as ``moe_utils.topk_routing_with_score_function`` computes
    them (without groups); probs in the logits' dtype."""
    bias = None if score_function == "softmax" or expert_bias is None else expert_bias.contiguous()
    scale = float(scaling_factor) if scaling_factor else 1.0
    return _FusedTopk.apply(logits, topk, score_function, bool(use_pre_softmax), scale, bias, False)


def fused_compute_score_for_moe_aux_loss(logits, topk, score_function):
    """``(routing_map, fp32 scores)`` as ``moe_utils.compute_routing_scores_for_aux_loss`` computes them."""
    scores, routing_map = _FusedTopk.apply(logits, topk, score_function, False, 1.0, None, True)
    return routing_map, scores
