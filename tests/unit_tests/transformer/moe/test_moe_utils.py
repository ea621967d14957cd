"""moe_utils against literal, loop-by-loop references of Megatron's formulas: load-balancing losses, z-loss,
capacity and token dropping, routing variants, permutation, the aux-loss scaler, the bias update and the tracker."""

import math

import pytest
import torch

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    get_capacity,
    get_updated_expert_bias,
    group_limited_topk,
    permute,
    sinkhorn,
    sort_chunks_by_idxs,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    unpermute,
    z_loss_func,
)
from tests.unit_tests.test_utilities import Utils, run_distributed


def _logits(tokens=12, experts=6, seed=0):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def test_switch_load_balancing_loss_is_e_sum_f_times_p():
    logits = _logits()
    tokens, experts, topk, coeff = logits.shape[0], logits.shape[1], 2, 0.1
    probs = torch.softmax(logits, dim=-1)
    chosen = probs.topk(topk, dim=-1).indices
    counts = torch.zeros(experts)
    for row in chosen:
        for e in row:
            counts[e] += 1
    f = [counts[i] / (tokens * topk) for i in range(experts)]
    p = [sum(probs[t, i] for t in range(tokens)) / tokens for i in range(experts)]
    expected = coeff * experts * sum(f[i] * p[i] for i in range(experts))
    actual = switch_load_balancing_loss_func(probs, counts, tokens, topk, experts, coeff)
    assert torch.allclose(actual, torch.as_tensor(expected), rtol=1e-6)
    # Balanced routing with uniform probabilities gives exactly coeff (the loss's minimum).
    uniform = torch.full((tokens, experts), 1.0 / experts)
    balanced = torch.full((experts,), tokens * topk / experts)
    assert torch.allclose(
        switch_load_balancing_loss_func(uniform, balanced, tokens, topk, experts, coeff), torch.tensor(coeff)
    )


def test_z_loss_is_mean_squared_logsumexp():
    logits = _logits()
    expected = sum(math.log(sum(math.exp(v) for v in row.tolist())) ** 2 for row in logits) / logits.shape[0]
    assert torch.allclose(z_loss_func(logits, 0.5), torch.tensor(0.5 * expected), rtol=1e-6)
    padding = torch.zeros(logits.shape[0], dtype=torch.bool)
    padding[-4:] = True
    kept = logits[:-4]
    expected_kept = sum(math.log(sum(math.exp(v) for v in row.tolist())) ** 2 for row in kept) / kept.shape[0]
    assert torch.allclose(z_loss_func(logits, 1.0, padding_mask=padding), torch.tensor(expected_kept), rtol=1e-6)


def test_capacity_formula():
    assert get_capacity(num_tokens=32, num_experts=4, capacity_factor=0.5) == 4
    assert get_capacity(num_tokens=10, num_experts=4, capacity_factor=1.0) == 3  # ceil(2.5)
    assert get_capacity(num_tokens=4, num_experts=8, capacity_factor=1.0, min_capacity=2) == 2


def _literal_drop(probs, routing_map, topk, factor, policy, pad):
    tokens, experts = probs.shape
    capacity = math.ceil(tokens * topk / experts * factor)
    keep = torch.zeros_like(routing_map)
    for e in range(experts):
        if capacity > tokens:
            keep[:, e] = True
            continue
        if policy == "probs":
            order = sorted(range(tokens), key=lambda t: -probs[t, e].item())
        else:  # earliest selected tokens first, then the rest
            order = [t for t in range(tokens) if routing_map[t, e]] + [
                t for t in range(tokens) if not routing_map[t, e]
            ]
        for t in order[:capacity]:
            keep[t, e] = True
    final = keep if pad else routing_map & keep
    return probs * final, final


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_token_dropping_matches_a_literal_reference(policy, pad):
    logits = _logits(tokens=16, experts=4, seed=3)
    probs, routing_map = topk_routing_with_score_function(logits, 2)
    actual_probs, actual_map = apply_router_token_dropping(probs, routing_map, 2, 0.5, policy, pad)
    expected_probs, expected_map = _literal_drop(probs, routing_map, 2, 0.5, policy, pad)
    assert torch.equal(actual_map, expected_map)
    assert torch.allclose(actual_probs, expected_probs)
    capacity = get_capacity(16 * 2, 4, 0.5)
    assert (actual_map.sum(0) <= capacity).all() and actual_map.sum() < routing_map.sum()  # tokens were dropped
    if pad:
        assert (actual_map.sum(0) == capacity).all()


def test_softmax_routing_variants():
    logits = _logits()
    probs, routing_map = topk_routing_with_score_function(logits, 2)
    for t in range(logits.shape[0]):
        top = logits[t].topk(2)
        assert set(routing_map[t].nonzero().flatten().tolist()) == set(top.indices.tolist())
        assert torch.allclose(probs[t, top.indices], torch.softmax(top.values, dim=0))
    pre, _ = topk_routing_with_score_function(logits, 2, use_pre_softmax=True, scaling_factor=2.0)
    full = torch.softmax(logits, dim=-1)
    top = full.topk(2, dim=-1)
    assert torch.allclose(pre.gather(1, top.indices), 2.0 * top.values)


def test_sigmoid_routing_with_expert_bias_chooses_by_biased_scores_and_weighs_by_unbiased():
    logits = _logits()
    bias = torch.linspace(-1, 1, logits.shape[1])
    probs, routing_map = topk_routing_with_score_function(logits, 2, score_function="sigmoid", expert_bias=bias)
    scores = torch.sigmoid(logits)
    for t in range(logits.shape[0]):
        chosen = (scores[t] + bias).topk(2).indices
        assert set(routing_map[t].nonzero().flatten().tolist()) == set(chosen.tolist())
        assert torch.allclose(probs[t, chosen], scores[t, chosen] / scores[t, chosen].sum())
    soft, _ = topk_routing_with_score_function(logits, 1, score_function="sqrtsoftplus")
    assert torch.allclose(soft.max(dim=1).values, torch.nn.functional.softplus(logits).sqrt().max(dim=1).values)


def test_group_limited_topk_picks_only_from_the_best_groups():
    scores = torch.softmax(_logits(tokens=5, experts=8), dim=-1)
    _, indices = group_limited_topk(scores, topk=2, num_tokens=5, num_experts=8, num_groups=4, group_topk=1)
    for t in range(5):
        group_scores = [scores[t, 2 * g : 2 * g + 2].topk(2).values.sum() for g in range(4)]
        best = max(range(4), key=lambda g: group_scores[g])
        assert set(indices[t].tolist()) == {2 * best, 2 * best + 1}


def test_aux_loss_scores_and_sinkhorn():
    logits = _logits()
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, 2, "sigmoid")
    assert torch.allclose(scores.sum(dim=1), torch.ones(logits.shape[0]))
    assert (routing_map.sum(dim=1) == 2).all()
    balanced = sinkhorn(logits)
    # Sinkhorn scales rows and columns of exp(logits) towards equal sums.
    assert torch.allclose(balanced.sum(dim=0), torch.full((6,), 1.0 / 6), atol=1e-3)


def test_permute_and_unpermute_round_trip():
    tokens = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=torch.bool)
    probs = torch.rand(5, 3) * routing_map
    permuted, permuted_probs, sorted_indices, _, _ = permute(tokens, routing_map, probs=probs, num_out_tokens=7)
    assert sorted_indices.tolist() == [0, 2, 4, 1, 2, 0, 3]  # expert 0's tokens, then expert 1's, then 2's
    assert torch.equal(permuted, tokens[sorted_indices])
    assert torch.allclose(
        permuted_probs, torch.stack([probs[t, e] for e, t in zip([0, 0, 0, 1, 1, 2, 2], sorted_indices.tolist())])
    )
    restored = unpermute(permuted, sorted_indices, tokens.shape, probs=probs, routing_map=routing_map)
    assert torch.allclose(restored, tokens * probs.sum(dim=1, keepdim=True))
    chunks, _ = sort_chunks_by_idxs(torch.arange(6.0).view(6, 1), torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1]))
    assert chunks.flatten().tolist() == [3.0, 4.0, 5.0, 0.0, 1.0, 2.0]


def test_drop_and_pad_permute_has_capacity_rows_per_expert():
    tokens = torch.randn(6, 2)
    routing_map = torch.tensor([[1, 0], [1, 1], [0, 1], [1, 0], [0, 0], [0, 1]], dtype=torch.bool)
    permuted, _, sorted_indices, _, _ = permute(tokens, routing_map, num_out_tokens=6, drop_and_pad=True)
    assert sorted_indices.view(2, 3).tolist() == [[0, 1, 3], [1, 2, 5]]
    restored = unpermute(permuted, sorted_indices, tokens.shape, drop_and_pad=True)
    assert torch.allclose(restored, tokens * routing_map.sum(dim=1, keepdim=True))


def test_aux_loss_scaler_injects_the_scaled_gradient():
    activation = torch.ones(3, requires_grad=True)
    aux_weight = torch.tensor(2.0, requires_grad=True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.25))
    try:
        out = MoEAuxLossAutoScaler.apply(activation, aux_weight * 3.0)
        assert torch.equal(out, activation)
        out.sum().backward()
        assert torch.allclose(aux_weight.grad, torch.tensor(0.75))  # d(3 w)/dw * 0.25
        assert torch.equal(activation.grad, torch.ones(3))
    finally:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def _bias_update():
    Utils.initialize_model_parallel(1)
    rank = torch.distributed.get_rank()
    counts = torch.tensor([[4.0, 0.0, 2.0, 2.0]]) if rank == 0 else torch.tensor([[0.0, 2.0, 2.0, 0.0]])
    bias = torch.tensor([[0.1, 0.0, -0.1, 0.0]])
    return get_updated_expert_bias(counts, bias, 0.01)


def test_expert_bias_update_matches_a_hand_computation():
    # Summed counts [4, 2, 4, 2], mean 3: experts 0 and 2 are over-loaded (bias - rate), 1 and 3 under (+ rate).
    for updated in run_distributed(2, _bias_update):
        assert torch.allclose(updated, torch.tensor([[0.09, 0.01, -0.11, 0.01]]))


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name] = value


def _tracker():
    Utils.initialize_model_parallel(1)
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    rank = torch.distributed.get_rank()
    # Two MoE layers of four (moe_layer_freq=2), one loss each; data-parallel ranks log different values.
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.0 + rank), 1, 4)
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(3.0 + rank), 3, 4)
    totals, writer = {}, _Writer()
    line = moe_utils.track_moe_metrics(
        0.5, 10, writer, total_loss_dict=totals, per_layer_logging=True, num_layers=4, moe_layer_freq=2
    )
    after = moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()
    return totals["load_balancing_loss"].item(), writer.scalars, line, after


def test_tracker_reduces_and_reports_like_megatron():
    for total, scalars, line, after in run_distributed(2, _tracker):
        # DP-averaged per-layer values [1.5, 0, 3.5, 0] * loss_scale 0.5, summed, over 2 MoE layers.
        assert total == pytest.approx((1.5 + 3.5) * 0.5 / 2)
        assert scalars["load_balancing_loss"] == pytest.approx(total)
        assert scalars["moe/load_balancing_loss_layer_2"] == pytest.approx(3.5 * 0.5)
        assert "load_balancing_loss" in line
        assert torch.equal(after, torch.zeros(4))  # cleared for the next interval


def test_router_gating_in_fp32_from_bf16_activations():
    generator = torch.Generator().manual_seed(1)
    inp = torch.randn(4, 2, 8, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(3, 8, generator=generator).bfloat16().requires_grad_()
    logits = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    assert logits.dtype == torch.float32 and logits.shape == (4, 2, 3)
    assert torch.allclose(logits, inp.float() @ weight.float().t())
    logits.sum().backward()
    assert inp.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.allclose(weight.grad.float(), inp.float().reshape(-1, 8).sum(0).expand(3, 8), rtol=1e-2)


def _inference_router():
    from megatron.core.transformer.moe.router import InferenceTopKRouter
    from tests.unit_tests.transformer.moe.moe_test_helpers import moe_config

    Utils.initialize_model_parallel(1)
    torch.manual_seed(0)
    router = InferenceTopKRouter(moe_config()).eval()
    x = torch.randn(8, 2, 16)
    with torch.no_grad():
        probs, indices = router(x)
        top = (x.reshape(-1, 16) @ router.weight.t()).topk(2, dim=-1)
    return probs, indices, torch.softmax(top.values, dim=-1), top.indices


def test_inference_router_returns_dense_topk():
    probs, indices, expected_probs, expected_indices = run_distributed(1, _inference_router)[0]
    assert probs.shape == (16, 2) and torch.equal(indices, expected_indices)
    assert torch.allclose(probs, expected_probs, atol=1e-6)
