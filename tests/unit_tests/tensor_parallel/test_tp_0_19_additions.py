"""Megatron-Core 0.19 additions to tensor_parallel: the new mappings (last-dim gather / reduce-scatter, uneven
sequence-parallel sizes, the global buffer, sp2hp / hp2sp), the frozen-weight linear, gradient-accumulation fusion
and deferred weight gradients in the linear function, and the cross-entropy building blocks."""

from math import prod

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.layers import (
    LinearWithFrozenWeight,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    gather_from_sequence_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.utils import drain_embedding_wgrad_compute
from tests.unit_tests.tensor_parallel.common import tp_rank
from tests.unit_tests.test_utilities import Utils, run_distributed


def _value(rank, shape, salt=0.0):
    return torch.arange(prod(shape), dtype=torch.float32).reshape(shape) + 1000.0 * rank + salt


def _forward_backward(fn, x, grad, **kwargs):
    x = x.clone().requires_grad_()
    y = fn(x, **kwargs)
    y.backward(grad)
    return y.detach(), x.grad


def _check_new_mappings(tp):
    Utils.initialize_model_parallel(tp)
    r = tp_rank()
    ranks = range(tp)
    shape = (4, 2, 8)
    local = shape[:-1] + (shape[-1] // tp,)

    # all-gather along the last dim; the gradient is reduce-scattered along it (summed, my slice kept).
    y, g = _forward_backward(all_gather_last_dim_from_tensor_parallel_region, _value(r, local), _value(r, shape, 0.5))
    assert torch.equal(y, torch.cat([_value(k, local) for k in ranks], dim=-1))
    assert torch.equal(g, sum(_value(k, shape, 0.5) for k in ranks).chunk(tp, dim=-1)[r])

    # reduce-scatter along the last dim; the gradient is gathered along it.
    y, g = _forward_backward(reduce_scatter_last_dim_to_tensor_parallel_region, _value(r, shape), _value(r, local))
    assert torch.equal(y, sum(_value(k, shape) for k in ranks).chunk(tp, dim=-1)[r])
    assert torch.equal(g, torch.cat([_value(k, local) for k in ranks], dim=-1))

    # Uneven sequence-parallel sizes: rank k holds k + 1 rows.
    sizes = [k + 1 for k in ranks]
    rows = (sizes[r], 3)
    y, g = _forward_backward(
        gather_from_sequence_parallel_region, _value(r, rows), _value(r, (sum(sizes), 3), 0.5), output_split_sizes=sizes
    )
    assert torch.equal(y, torch.cat([_value(k, (sizes[k], 3)) for k in ranks]))
    start = sum(sizes[:r])
    assert torch.equal(g, sum(_value(k, (sum(sizes), 3), 0.5) for k in ranks)[start : start + sizes[r]])
    y, g = _forward_backward(
        gather_from_sequence_parallel_region,
        _value(r, rows),
        _value(r, (sum(sizes), 3), 0.5),
        tensor_parallel_output_grad=False,
        output_split_sizes=sizes,
    )
    assert torch.equal(g, _value(r, (sum(sizes), 3), 0.5)[start : start + sizes[r]])
    y, g = _forward_backward(
        reduce_scatter_to_sequence_parallel_region,
        _value(r, (sum(sizes), 3)),
        _value(r, rows, 0.5),
        input_split_sizes=sizes,
    )
    assert torch.equal(y, sum(_value(k, (sum(sizes), 3)) for k in ranks)[start : start + sizes[r]])
    assert torch.equal(g, torch.cat([_value(k, (sizes[k], 3), 0.5) for k in ranks]))

    # The global buffer: same values, memory owned by parallel_state's buffer.
    y = gather_from_sequence_parallel_region(_value(r, (2, 3)), use_global_buffer=True)
    assert torch.equal(y, torch.cat([_value(k, (2, 3)) for k in ranks]))
    buffer_tensor = parallel_state.get_global_memory_buffer().get_tensor((2 * tp, 3), torch.float32, "mpu")
    assert y.data_ptr() == buffer_tensor.data_ptr()

    # sp2hp: [tokens/tp, H] -> [tokens, H/tp]; hp2sp undoes it; gradients flow back the same way.
    tokens_local, hidden = 2, 8
    sp = _value(r, (tokens_local, hidden))
    full = torch.cat([_value(k, (tokens_local, hidden)) for k in ranks])  # all tokens, in rank order
    y, g = _forward_backward(all_to_all_sp2hp, sp, _value(r, (tokens_local * tp, hidden // tp), 0.5))
    assert torch.equal(y, full.chunk(tp, dim=-1)[r])
    back = all_to_all_hp2sp(y)
    assert torch.equal(back, sp)
    expected_grad = torch.cat(
        [_value(k, (tokens_local * tp, hidden // tp), 0.5)[r * tokens_local : (r + 1) * tokens_local] for k in ranks],
        dim=-1,
    )
    assert torch.equal(g, expected_grad)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_new_mappings_by_hand(tp):
    assert all(run_distributed(4, _check_new_mappings, tp))


def test_new_mappings_are_identity_without_groups():
    parallel_state.destroy_model_parallel()
    x = torch.ones(2, 4)
    for fn in (
        all_gather_last_dim_from_tensor_parallel_region,
        reduce_scatter_last_dim_to_tensor_parallel_region,
        all_to_all_sp2hp,
        all_to_all_hp2sp,
    ):
        assert fn(x) is x


# ---- linear functions ------------------------------------------------------------------------------------------


def test_frozen_weight_linear_skips_the_weight_gradient():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, requires_grad=True)
    weight = torch.randn(6, 4, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    y = linear_with_frozen_weight(x, weight, bias, False, False, False, tp_group=None)
    assert torch.allclose(y, F.linear(x, weight, bias))
    assert y.grad_fn.name().startswith("LinearWithFrozenWeight")
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.allclose(x.grad, grad @ weight)
    assert weight.grad is None and bias.grad is None  # no weight (or bias) gradient at all
    assert issubclass(LinearWithFrozenWeight, torch.autograd.Function)
    with pytest.raises(ValueError, match=r"grad_output_buffer and wgrad_deferral_limit must be None"):
        linear_with_frozen_weight(x, weight, None, False, False, False, None, grad_output_buffer=[])
    with pytest.raises(ValueError, match=r"not supported yet: GTP weight rematerialisation \(gtp_remat_size=2\)"):
        linear_with_frozen_weight(x, weight, None, False, False, False, None, gtp_remat_size=2)


def _frozen_weight_tp(sequence_parallel):
    Utils.initialize_model_parallel(2)
    r = tp_rank()
    torch.manual_seed(0)
    full_x = torch.randn(4, 2, 6)
    weight = torch.randn(8, 6)  # the whole (column-parallel) weight; this rank keeps its rows
    local_w = weight.chunk(2, dim=0)[r]
    x = (full_x.chunk(2, dim=0)[r] if sequence_parallel else full_x).clone().requires_grad_()
    y = linear_with_frozen_weight(
        x,
        local_w,
        None,
        False,
        allreduce_dgrad=not sequence_parallel,
        sequence_parallel=sequence_parallel,
        tp_group=None,
    )
    y.sum().backward()
    reference_x = full_x.clone().requires_grad_()
    F.linear(reference_x, weight).sum().backward()
    expected_grad = reference_x.grad.chunk(2, dim=0)[r] if sequence_parallel else reference_x.grad
    return torch.allclose(y, F.linear(full_x, local_w), atol=1e-5), torch.allclose(x.grad, expected_grad, atol=1e-5)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_frozen_weight_linear_reduces_the_input_gradient_over_tp(sequence_parallel):
    assert run_distributed(2, _frozen_weight_tp, sequence_parallel) == [(True, True), (True, True)]


def test_gradient_accumulation_fusion_adds_into_main_grad():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(5, 4))
    weight.main_grad = torch.ones(5, 4)
    grad = torch.randn(3, 2, 5)
    y = linear_with_grad_accumulation_and_async_allreduce(x, weight, None, True, False, False)
    # The same weight used a second time (as a tied embedding is): that gradient reaches weight.grad.
    extra = (weight * 2.0).sum()
    torch.autograd.backward([y, extra], [grad, torch.tensor(1.0)])
    wgrad = grad.reshape(-1, 5).t() @ x.detach().reshape(-1, 4)
    assert torch.allclose(weight.main_grad, 1.0 + wgrad, atol=1e-6)
    assert torch.allclose(weight.grad, torch.full((5, 4), 2.0))  # only the other use; the fused part is zero
    assert torch.allclose(x.grad, grad @ weight.detach(), atol=1e-6)


def test_deferred_weight_gradients_are_buffered_then_drained():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 4))
    weight.main_grad = torch.zeros(5, 4)
    inputs = [torch.randn(3, 2, 4) for _ in range(3)]
    grads = [torch.randn(3, 2, 5) for _ in range(3)]
    activation_buffer, grad_output_buffer = [], []
    for x, g in zip(inputs, grads):
        y = linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, True, False, False, grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=2
        )
        activation_buffer.append(x)
        y.backward(g)
    # Two deferred (the limit), the third computed at once.
    assert len(grad_output_buffer) == 2
    third = grads[2].reshape(-1, 5).t() @ inputs[2].reshape(-1, 4)
    assert torch.allclose(weight.main_grad, third, atol=1e-5)

    class Config:
        sequence_parallel = False
        gradient_accumulation_fusion = True

    drain_embedding_wgrad_compute(Config(), activation_buffer[:2], grad_output_buffer, weight, tp_group=None)
    total = sum(g.reshape(-1, 5).t() @ x.reshape(-1, 4) for g, x in zip(grads, inputs))
    assert torch.allclose(weight.main_grad, total, atol=1e-5)


def _duplicates():
    Utils.initialize_model_parallel(2, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    split = torch.nn.Parameter(torch.ones(1))
    split.tensor_model_parallel = True
    replicated = torch.nn.Parameter(torch.ones(1))
    expert = torch.nn.Parameter(torch.ones(1))
    expert.allreduce = False
    return (
        param_is_not_tensor_parallel_duplicate(split),
        param_is_not_tensor_parallel_duplicate(replicated),
        param_is_not_tensor_parallel_duplicate(expert),  # expert TP size 1: every rank holds its own copy once
    )


def test_param_is_not_tensor_parallel_duplicate_uses_the_expert_group_for_experts():
    assert run_distributed(2, _duplicates) == [(True, True, True), (True, False, True)]


# ---- cross entropy building blocks -----------------------------------------------------------------------------


def test_cross_entropy_building_blocks_compose_to_the_loss_and_gradient():
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 7, dtype=torch.bfloat16)
    target = torch.randint(0, 7, (3, 2))
    original = logits.clone()
    as_float, logits_max = VocabParallelCrossEntropy.calculate_logits_max(logits)
    assert as_float.dtype == torch.float32 and torch.equal(logits_max, as_float.max(dim=-1).values)
    target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
        VocabParallelCrossEntropy.calculate_predicted_logits(as_float, target, logits_max, 0, 7)
    )
    assert torch.equal(logits, original)  # the input is left unchanged
    assert not target_mask.any() and torch.equal(masked_target_1d, target.reshape(-1))
    softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    reference = F.cross_entropy(as_float.view(-1, 7), target.view(-1), reduction="none").view(3, 2)
    assert torch.allclose(loss, reference, atol=1e-5)
    grad_2d, arange_1d, softmax_update, grad_input = VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
        softmax, target_mask
    )
    grad_output = torch.rand(3, 2)
    grad = VocabParallelCrossEntropy.calculate_gradients(
        grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
    )
    leaf = as_float.clone().requires_grad_()
    F.cross_entropy(leaf.view(-1, 7), target.view(-1), reduction="none").view(3, 2).backward(grad_output)
    assert torch.allclose(grad, leaf.grad, atol=1e-6)


def test_cross_entropy_building_blocks_mask_targets_owned_elsewhere():
    logits = torch.zeros(1, 4)
    target = torch.tensor([5])  # owned by the rank holding vocabulary [4, 8)
    mask, masked, predicted, sum_exp, _ = VocabParallelCrossEntropy.calculate_predicted_logits(
        logits, target, torch.zeros(1), 0, 4
    )
    assert mask.tolist() == [True] and masked.tolist() == [0] and predicted.tolist() == [0.0]
    assert sum_exp.tolist() == [4.0]
