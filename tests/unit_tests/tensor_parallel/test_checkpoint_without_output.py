"""CheckpointWithoutOutput frees a block's output and recomputes it before the next op's backward; plus the small
0.19 additions to tensor_parallel.random."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import (
    CheckpointWithoutOutput,
    convert_cuda_rng_state,
    get_cuda_rng_tracker,
    initialize_rng_tracker,
    is_graph_safe_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tensor_parallel.random import (
    CheckpointWithoutOutputFunction,
    CudaRNGStatesTracker,
    checkpoint,
    get_all_rng_states,
    is_checkpointing,
)


@pytest.fixture(autouse=True)
def _restore_global_rng():
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)
    initialize_rng_tracker(force_reset=True)


def _block(x, w):
    # Dropout inside: the recomputation must draw the same mask.
    return F.dropout(torch.nn.functional.gelu(x @ w), p=0.3, training=True)


def _setup():
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w1 = torch.randn(16, 32, requires_grad=True)
    w2 = torch.randn(32, 4, requires_grad=True)
    return x, w1, w2


def test_output_is_freed_then_recomputed_with_equal_gradients():
    x, w1, w2 = _setup()
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(7)
    reference = (_block(x, w1) @ w2).square().sum()
    reference.backward()
    expected = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None

    torch.manual_seed(7)
    ckpt = CheckpointWithoutOutput()
    hidden = ckpt.checkpoint(_block, x, w1)
    out = hidden @ w2  # matmul's backward saves `hidden` for w2's gradient
    ckpt.discard_output_and_register_recompute(out)
    assert hidden.untyped_storage().size() == 0  # the output's memory is gone
    loss = out.square().sum()
    assert torch.allclose(loss, reference)
    loss.backward()
    for got, want in zip((x.grad, w1.grad, w2.grad), expected):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert hidden.untyped_storage().size() > 0  # refilled by the recomputation
    assert ckpt.ctx is None and ckpt.recomputed_outputs is None  # references released after backward


def test_backward_without_discard_recomputes_in_the_node():
    x, w1, w2 = _setup()
    torch.manual_seed(3)
    (_block(x, w1) @ w2).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    torch.manual_seed(3)
    ckpt = CheckpointWithoutOutput()
    (ckpt.checkpoint(_block, x, w1) @ w2).sum().backward()
    assert torch.allclose(x.grad, expected, rtol=1e-5, atol=1e-6)


def test_tuple_outputs_and_non_tensor_arguments():
    x, w1, _ = _setup()

    def two_outputs(inp, weight, scale):
        y = inp @ weight
        return y * scale, y.relu()

    ref_a, ref_b = two_outputs(x, w1, 2.0)
    (ref_a.sum() + ref_b.square().sum()).backward()
    expected = w1.grad.clone()
    w1.grad = None
    ckpt = CheckpointWithoutOutput()
    a, b = ckpt.checkpoint(two_outputs, x, w1, 2.0)
    total = a.exp().sum() * 0 + a.sum() + b.square().sum()  # exp saves `a`; square saves `b`
    ckpt.discard_output_and_register_recompute(total)
    assert a.untyped_storage().size() == 0 and b.untyped_storage().size() == 0
    total.backward()
    assert torch.allclose(w1.grad, expected, rtol=1e-5, atol=1e-6)


def test_an_output_that_is_a_view_of_an_input_is_not_freed():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 2, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    same = ckpt.checkpoint(lambda t: t.view(3, 4), x)
    out = same.view(4, 3) @ w
    ckpt.discard_output_and_register_recompute(out)
    assert x.untyped_storage().size() > 0 and same.untyped_storage().size() > 0
    out.sum().backward()
    assert torch.allclose(x.grad, torch.ones(4, 2) @ w.detach().t())


def test_checkpoint_without_output_refusals():
    with pytest.raises(ValueError, match=r"not supported yet: FP8 recomputation in CheckpointWithoutOutput"):
        CheckpointWithoutOutput(fp8=True)
    with pytest.raises(RuntimeError, match=r"call checkpoint\(\) before"):
        CheckpointWithoutOutput().discard_output_and_register_recompute(torch.ones(1))
    assert issubclass(CheckpointWithoutOutputFunction, torch.autograd.Function)


def test_is_checkpointing_inside_both_recomputation_kinds():
    seen = []

    def record(x):
        seen.append(is_checkpointing())
        return x * 2

    x = torch.ones(2, requires_grad=True)
    assert not is_checkpointing()
    checkpoint(record, False, x).sum().backward()
    ckpt = CheckpointWithoutOutput()
    out = ckpt.checkpoint(record, x)
    (out * out).sum().backward()
    assert seen == [True, True, True, True]  # first run and recomputation of each
    assert not is_checkpointing()


def test_rng_state_helpers():
    state = torch.get_rng_state()
    generator = convert_cuda_rng_state(state, to_graphable=True)
    assert isinstance(generator, torch.Generator) and torch.equal(generator.get_state(), state)
    assert convert_cuda_rng_state(generator, to_graphable=True) is generator
    assert torch.equal(convert_cuda_rng_state(generator), state)
    assert convert_cuda_rng_state(state) is state
    assert not is_graph_safe_cuda_rng_tracker(get_cuda_rng_tracker())
    with pytest.raises(ValueError, match=r"not supported yet: CUDA-graph-safe RNG states"):
        CudaRNGStatesTracker(use_cudagraphable_rng=True)
    assert CudaRNGStatesTracker(is_inference_rng_tracker=True).is_inference_rng_tracker

    model_parallel_cuda_manual_seed(5)
    random.seed(1)
    np.random.seed(2)
    states = get_all_rng_states()
    assert set(states) >= {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"}
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.setstate(states["random_rng_state"])
    np.random.set_state(states["np_rng_state"])
    torch.set_rng_state(states["torch_rng_state"])
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])
    assert set(states["rng_tracker_states"]) == set(get_cuda_rng_tracker().get_states())
