"""Each mapping's forward and backward at TP=2 (inside a 4-rank world: two TP groups) and TP=4, by hand."""

from math import prod

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from tests.unit_tests.tensor_parallel.common import tp_rank
from tests.unit_tests.test_utilities import Utils, run_distributed

SHAPE = (4, 3, 8)  # [s, b, h]: both dim 0 and the last dim split over 2 or 4 ranks


def _value(rank: int, shape=SHAPE, salt: float = 0.0) -> torch.Tensor:
    """A tensor that says which rank it belongs to."""
    return torch.arange(prod(shape), dtype=torch.float32).reshape(shape) + 1000.0 * rank + salt


def _forward_backward(fn, x, grad, **kwargs):
    x = x.clone().requires_grad_()
    y = fn(x, **kwargs)
    y.backward(grad)
    return y.detach(), x.grad


def _check_mappings(tp):
    Utils.initialize_model_parallel(tp)
    group = parallel_state.get_tensor_model_parallel_group()
    r = tp_rank()
    ranks = range(tp)
    mine = lambda t, dim: t.chunk(tp, dim=dim)[r]  # noqa: E731

    # copy_to: identity forward; the gradient is summed over the group.
    y, g = _forward_backward(copy_to_tensor_model_parallel_region, _value(r), _value(r, salt=0.5))
    assert torch.equal(y, _value(r))
    assert torch.equal(g, sum(_value(k, salt=0.5) for k in ranks))

    # reduce_from: sum forward; the gradient passes through.
    y, g = _forward_backward(reduce_from_tensor_model_parallel_region, _value(r), _value(r, salt=0.5), group=group)
    assert torch.equal(y, sum(_value(k) for k in ranks))
    assert torch.equal(g, _value(r, salt=0.5))

    # scatter_to_tensor: keep my slice of the last dim; the gradient is gathered along the last dim.
    local = SHAPE[:-1] + (SHAPE[-1] // tp,)
    y, g = _forward_backward(scatter_to_tensor_model_parallel_region, _value(0), _value(r, local))
    assert torch.equal(y, mine(_value(0), -1))
    assert torch.equal(g, torch.cat([_value(k, local) for k in ranks], dim=-1))

    # gather_from_tensor: concatenate along the last dim; each rank keeps its slice of the gradient.
    y, g = _forward_backward(gather_from_tensor_model_parallel_region, _value(r, local), _value(r), group=group)
    assert torch.equal(y, torch.cat([_value(k, local) for k in ranks], dim=-1))
    assert torch.equal(g, mine(_value(r), -1))

    # scatter_to_sequence: keep my slice of dim 0; the gradient is gathered along dim 0.
    seq_local = (SHAPE[0] // tp,) + SHAPE[1:]
    y, g = _forward_backward(scatter_to_sequence_parallel_region, _value(0), _value(r, seq_local))
    assert torch.equal(y, mine(_value(0), 0))
    assert torch.equal(g, torch.cat([_value(k, seq_local) for k in ranks], dim=0))

    # gather_from_sequence: concatenate along dim 0; backward reduce-scatters (TP consumer) or splits.
    y, g = _forward_backward(gather_from_sequence_parallel_region, _value(r, seq_local), _value(r, salt=0.5))
    assert torch.equal(y, torch.cat([_value(k, seq_local) for k in ranks], dim=0))
    assert torch.equal(g, mine(sum(_value(k, salt=0.5) for k in ranks), 0))
    y, g = _forward_backward(
        gather_from_sequence_parallel_region,
        _value(r, seq_local),
        _value(r, salt=0.5),
        tensor_parallel_output_grad=False,
        group=group,
    )
    assert torch.equal(g, mine(_value(r, salt=0.5), 0))

    # reduce_scatter_to_sequence: sum, keep my slice of dim 0; the gradient is gathered along dim 0.
    y, g = _forward_backward(reduce_scatter_to_sequence_parallel_region, _value(r), _value(r, seq_local, 0.5))
    assert torch.equal(y, mine(sum(_value(k) for k in ranks), 0))
    assert torch.equal(g, torch.cat([_value(k, seq_local, 0.5) for k in ranks], dim=0))

    # all_to_all with uneven splits: rank r sends r + 1 + i rows to rank i; a row says (source, destination, row).
    def rows(source, destination, count, salt=0.0):
        return torch.stack([torch.full((2,), 1000.0 * source + 10.0 * destination + j + salt) for j in range(count)])

    sent = torch.cat([rows(r, i, r + 1 + i) for i in ranks])
    received = torch.cat([rows(k, r, k + 1 + r) for k in ranks])
    x = sent.clone().requires_grad_()
    y = all_to_all(group, x, [k + 1 + r for k in ranks], [r + 1 + i for i in ranks])
    assert torch.equal(y, received)
    y.backward(received + 0.5)  # each row's gradient goes back to the rank and row it came from
    assert torch.equal(x.grad, sent + 0.5)
    y = all_to_all(group, _value(r, (tp, 2)))  # equal splits: row i goes to rank i
    assert torch.equal(y, torch.stack([_value(k, (tp, 2))[r] for k in ranks]))

    # Sizes that do not split over the group are refused with the sizes named.
    with pytest.raises(
        ValueError,
        match=rf"dimension 0 \(sequence\) of size 3 \(tensor shape \(3, 2\)\) is not "
        rf"divisible by the tensor-parallel size {tp}",
    ):
        scatter_to_sequence_parallel_region(torch.ones(3, 2))
    with pytest.raises(ValueError, match=rf"last dimension of size 3 .* tensor-parallel size {tp}"):
        scatter_to_tensor_model_parallel_region(torch.ones(2, 3))
    with pytest.raises(ValueError, match=rf"dimension 0 \(sequence\) of size 5 .* tensor-parallel size {tp}"):
        reduce_scatter_to_sequence_parallel_region(torch.ones(5, 2))
    return True


@pytest.mark.parametrize("tp, world_size", [(2, 4), (4, 4)])
def test_mappings_forward_and_backward(tp, world_size):
    assert run_distributed(world_size, _check_mappings, tp) == [True] * world_size


def test_single_rank_mappings_are_identities():
    # Without model-parallel groups every wrapper is the identity on the very same tensor.
    x = torch.randn(4, 2, 6)
    for fn in (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        scatter_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    ):
        assert fn(x) is x


def test_all_to_all_needs_a_group():
    with pytest.raises(ValueError, match=r"all_to_all needs an explicit process group \(got group=None\)"):
        all_to_all(None, torch.ones(2))
