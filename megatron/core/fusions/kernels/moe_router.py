"""Triton kernels for MoE routing (``--moe-router-fusion``): scores, top-k, probabilities and their backward.

One program owns one token's row of router logits (all experts in one block). Forward scores the row (softmax,
sigmoid or sqrt(softplus)), picks the top k by k rounds of "largest value, lowest index among equals", and writes the
dense probabilities and the routing map; with ``AUX`` it writes instead the scores over all experts the
load-balancing losses use (normalised to sum 1) and their top-k map. Backward recomputes the scores from the logits
and the saved map: nothing besides the logits and the map is kept.

``SCORE``: 0 softmax, 1 sigmoid, 2 sqrt(softplus). Formulas are those of ``moe_utils.topk_routing_with_score_function``
and ``compute_routing_scores_for_aux_loss``.
"""

import torch
import triton
import triton.language as tl

SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
MAX_EXPERTS = 4096  # one row is one block


@triton.jit
def _score(x, valid, SCORE: tl.constexpr):
    """The score function of ``x`` (fp32), zero outside ``valid``; softmax is over the valid entries."""
    if SCORE == 0:
        e = tl.where(valid, tl.exp(x - tl.max(tl.where(valid, x, -float("inf")), axis=0)), 0.0)
        s = e / tl.sum(e, axis=0)
    elif SCORE == 1:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        # softplus = log1p(exp(x)), with PyTorch's threshold (x above 20 is returned as is); log1p(e) is
        # log(1 + e) * e / ((1 + e) - 1), exact where 1 + e rounds (Goldberg's trick: Triton has no log1p)
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        s = tl.sqrt(tl.where(x > 20.0, x, log1p))
    return tl.where(valid, s, 0.0)


@triton.jit
def _topk_fwd(
    logits_ptr,
    bias_ptr,
    probs_ptr,
    map_ptr,
    num_experts,
    topk,
    scale,
    SCORE: tl.constexpr,
    PRE_SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    AUX: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + row * num_experts + cols, mask=valid, other=0.0).to(tl.float32)
    scores = _score(x, valid, SCORE)
    if SCORE != 0 and AUX:
        scores = scores / (tl.sum(scores, axis=0) + 1e-20)
    if SCORE == 0 and not PRE_SOFTMAX and not AUX:
        choice = x  # top-k of the logits, softmax over the chosen ones
    else:
        choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, -float("inf"))
    chosen = cols < 0
    for _ in range(topk):
        best = tl.max(choice, axis=0)
        index = tl.min(tl.where(choice == best, cols, BLOCK_E), axis=0)
        chosen = chosen | (cols == index)
        choice = tl.where(cols == index, -float("inf"), choice)
    if AUX:
        probs = scores
    elif SCORE == 0 and not PRE_SOFTMAX:
        probs = _score(x, chosen, 0)
    else:
        probs = tl.where(chosen, scores, 0.0)
        if SCORE != 0 and NORMALIZE:
            probs = probs / (tl.sum(probs, axis=0) + 1e-20)
    if not AUX:
        probs = probs * scale
    tl.store(probs_ptr + row * num_experts + cols, probs.to(probs_ptr.dtype.element_ty), mask=valid)
    tl.store(map_ptr + row * num_experts + cols, chosen.to(tl.int8), mask=valid)


@triton.jit
def _topk_bwd(
    logits_ptr,
    map_ptr,
    grad_ptr,
    grad_logits_ptr,
    num_experts,
    scale,
    SCORE: tl.constexpr,
    PRE_SOFTMAX: tl.constexpr,
    NORMALIZE: tl.constexpr,
    AUX: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    offsets = row * num_experts + cols
    x = tl.load(logits_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    chosen = tl.load(map_ptr + offsets, mask=valid, other=0) != 0
    g = tl.load(grad_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    if AUX:
        used = valid
    else:
        used = chosen
        g = tl.where(chosen, g * scale, 0.0)
    if SCORE == 0:
        # softmax over all experts (AUX, pre-softmax) or over the chosen ones
        s = _score(x, valid if (AUX or PRE_SOFTMAX) else chosen, 0)
        grad = s * (g - tl.sum(g * s, axis=0))
    else:
        f = _score(x, valid, SCORE)
        sig = 1.0 / (1.0 + tl.exp(-x))
        if SCORE == 1:
            df = f * (1.0 - f)
        else:
            df = tl.where(x > 20.0, 1.0, sig) / (2.0 * f)
        if AUX or NORMALIZE:
            t = tl.where(used, f, 0.0)
            total = tl.sum(t, axis=0) + 1e-20
            dt = g / total - tl.sum(g * t, axis=0) / (total * total)
        else:
            dt = g
        grad = tl.where(used, dt * df, 0.0)
    tl.store(grad_logits_ptr + offsets, grad.to(grad_logits_ptr.dtype.element_ty), mask=valid)


def _block(num_experts: int) -> int:
    return triton.next_power_of_2(num_experts)


def topk_forward(logits, topk, score_function, pre_softmax, scale, expert_bias, aux):
    """``(dense probs (or aux scores) [tokens, experts], routing map bool [tokens, experts])``."""
    tokens, num_experts = logits.shape
    # Aux-loss scores are fp32 (the losses' input); router probs come back in the logits' dtype, as in PyTorch.
    probs = torch.empty_like(logits, dtype=torch.float32 if aux else logits.dtype)
    routing_map = torch.empty((tokens, num_experts), dtype=torch.bool, device=logits.device)
    _topk_fwd[(tokens,)](
        logits,
        logits if expert_bias is None else expert_bias,
        probs,
        routing_map.view(torch.int8),
        num_experts,
        topk,
        scale,
        SCORES[score_function],
        pre_softmax,
        expert_bias is not None,
        topk > 1,
        aux,
        BLOCK_E=_block(num_experts),
    )
    return probs, routing_map


def topk_backward(logits, routing_map, grad, topk, score_function, pre_softmax, scale, aux):
    """The gradient of the logits from the gradient of ``topk_forward``'s first output."""
    grad_logits = torch.empty_like(logits)
    _topk_bwd[(logits.shape[0],)](
        logits,
        routing_map.view(torch.int8),
        grad,
        grad_logits,
        logits.shape[1],
        scale,
        SCORES[score_function],
        pre_softmax,
        topk > 1,
        aux,
        BLOCK_E=_block(logits.shape[1]),
    )
    return grad_logits


_ROW = {"num_experts": "i32"}
AOT_SIGNATURES = [
    (
        _topk_fwd,
        {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "probs_ptr": "*fp32", "map_ptr": "*i8"}
        | _ROW
        | {"topk": "i32", "scale": "fp32"}
        | {f: "constexpr" for f in ("SCORE", "PRE_SOFTMAX", "HAS_BIAS", "NORMALIZE", "AUX", "BLOCK_E")},
        {"SCORE": score, "PRE_SOFTMAX": pre, "HAS_BIAS": score == 1, "NORMALIZE": True, "AUX": aux, "BLOCK_E": 64},
    )
    for score, pre, aux in ((0, False, False), (0, True, False), (1, False, False), (2, False, True))
] + [
    (
        _topk_bwd,
        {"logits_ptr": "*fp32", "map_ptr": "*i8", "grad_ptr": "*fp32", "grad_logits_ptr": "*fp32"}
        | _ROW
        | {"scale": "fp32"}
        | {f: "constexpr" for f in ("SCORE", "PRE_SOFTMAX", "NORMALIZE", "AUX", "BLOCK_E")},
        {"SCORE": score, "PRE_SOFTMAX": pre, "NORMALIZE": True, "AUX": aux, "BLOCK_E": 64},
    )
    for score, pre, aux in ((0, False, False), (0, True, False), (1, False, False), (2, False, True))
]
