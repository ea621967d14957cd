"""RNG streams (tracker fork, states, seeds) and activation recomputation that replays them."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    CudaRNGStatesTracker,
    RowParallelLinear,
    checkpoint,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    initialize_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tensor_parallel.random import InferenceCudaRNGStatesTracker
from megatron.core.utils import init_method_normal
from tests.unit_tests.tensor_parallel.common import assert_rel_close, gather, tp_rank
from tests.unit_tests.test_utilities import Utils, run_distributed


@pytest.fixture(autouse=True)
def _restore_global_rng():
    """These tests reseed this process's generators and tracker; leave them as they were found."""
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)
    initialize_rng_tracker(force_reset=True)


def _draws(seed, n=3):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


# ---- the tracker -----------------------------------------------------------------------------------------------------


def test_fork_draws_from_the_stream_and_leaves_the_default_stream_alone():
    tracker = CudaRNGStatesTracker()
    tracker.add("stream", 11)
    torch.manual_seed(0)
    expected_default = torch.rand(4)
    torch.manual_seed(0)
    with tracker.fork("stream"):
        first = torch.rand(3)
    with tracker.fork("stream"):
        second = torch.rand(3)  # the stream continues where it stopped
    assert torch.equal(torch.rand(4), expected_default)
    assert torch.equal(torch.cat([first, second]), _draws(11, 6))


def test_fork_restores_the_default_stream_when_the_block_raises():
    tracker = CudaRNGStatesTracker()
    tracker.add("stream", 11)
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="inside the fork"):
        with tracker.fork("stream"):
            torch.rand(5)
            raise RuntimeError("inside the fork")
    assert torch.equal(torch.rand(2), expected)


def test_states_can_be_saved_and_replayed():
    tracker = CudaRNGStatesTracker()
    tracker.add("stream", 11)
    saved = tracker.get_states()
    with tracker.fork("stream"):
        first = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("stream"):
        again = torch.rand(3)
    assert torch.equal(first, again)
    with tracker.fork("stream"):
        torch.rand(1)
    tracker.set_states(saved)  # the forks above did not change the caller's dict
    with tracker.fork("stream"):
        assert torch.equal(torch.rand(3), first)


def test_add_refuses_duplicates_and_fork_refuses_unknown_streams():
    tracker = CudaRNGStatesTracker()
    tracker.add("stream", 11)
    assert tracker.is_initialized()
    with pytest.raises(ValueError, match="RNG stream 'stream' already exists; call reset"):
        tracker.add("stream", 12)
    with pytest.raises(ValueError, match="RNG seed 11 is already used by another stream; give stream 'other'"):
        tracker.add("other", 11)
    with pytest.raises(
        KeyError,
        match=r"RNG stream 'missing' was never added \(known: \['stream'\]\); call "
        r"model_parallel_cuda_manual_seed",
    ):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    assert not tracker.is_initialized()
    tracker.add("stream", 11)  # allowed again after reset


def test_model_parallel_seeds_follow_megatron():
    model_parallel_cuda_manual_seed(100, tp_rank=3, ep_rank=2, etp_rank=1)
    tracker = get_cuda_rng_tracker()
    assert torch.equal(torch.rand(3), _draws(100))  # default stream: the seed itself
    expected = {
        "model-parallel-rng": 100 + 2718 + 3,
        get_expert_parallel_rng_tracker_name(): 100 + 1024 + 100 * 2 + 1,
        get_data_parallel_rng_tracker_name(): 100,
    }
    assert set(tracker.get_states()) == set(expected)
    for name, seed in expected.items():
        with tracker.fork(name):
            assert torch.equal(torch.rand(3), _draws(seed)), name
    with tracker.fork():  # the default fork is the tensor-parallel stream, continuing after the 3 draws above
        assert torch.equal(torch.rand(3), _draws(100 + 2718 + 3, 6)[3:])


def test_inference_tracker_never_switches_streams():
    model_parallel_cuda_manual_seed(5, inference_rng_tracker=True)
    tracker = get_cuda_rng_tracker()
    assert isinstance(tracker, InferenceCudaRNGStatesTracker)
    with tracker.fork():
        inside = torch.rand(3)
    assert torch.equal(inside, _draws(5))
    model_parallel_cuda_manual_seed(5)
    assert type(get_cuda_rng_tracker()) is CudaRNGStatesTracker


def test_transformer_engine_tracker_falls_back_with_a_warning():
    with pytest.warns(UserWarning, match="use_te_rng_tracker=True needs Transformer Engine"):
        model_parallel_cuda_manual_seed(5, te_rng_tracker=True)
    assert type(get_cuda_rng_tracker()) is CudaRNGStatesTracker


# ---- activation recomputation ----------------------------------------------------------------------------------------


def _dropout_block(x, weight, scale, unused):
    """Dropout from the default stream and from the tensor-parallel stream; two outputs; non-tensor arguments."""
    assert unused is None
    hidden = F.dropout(x @ weight, p=0.5, training=True)
    with get_cuda_rng_tracker().fork():
        hidden = F.dropout(torch.tanh(hidden), p=0.5, training=True)
    return hidden * scale, hidden.sum()


def _run_dropout_block(use_checkpoint):
    model_parallel_cuda_manual_seed(42)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=g).requires_grad_()
    weight = torch.randn(4, 5, generator=g).requires_grad_()
    if use_checkpoint:
        out, total = checkpoint(_dropout_block, False, x, weight, 2.0, None)
    else:
        out, total = _dropout_block(x, weight, 2.0, None)
    (out * torch.arange(30.0).view(6, 5)).sum().add(total).backward()
    with get_cuda_rng_tracker().fork():
        after_tp = torch.rand(2)
    return out.detach(), x.grad, weight.grad, torch.rand(2), after_tp


def test_checkpoint_replays_dropout_and_matches_no_checkpointing():
    plain = _run_dropout_block(use_checkpoint=False)
    recomputed = _run_dropout_block(use_checkpoint=True)
    names = ("output", "x grad", "weight grad", "default stream afterwards", "TP stream afterwards")
    for name, a, b in zip(names, plain, recomputed):
        assert torch.equal(a, b), name


S, B, H, FFN = 8, 2, 8, 16


def _checkpointed_mlp_results(tp):
    """A column -> gelu -> TP-stream dropout -> row -> dropout block: plain, checkpointed, and checkpointed with
    the saved input distributed over the TP group. Returns gathered outputs and gradients per mode."""
    Utils.initialize_model_parallel(tp)
    config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
    torch.manual_seed(9)
    fc1 = ColumnParallelLinear(H, FFN, config=config, init_method=init_method_normal(0.5))
    fc2 = RowParallelLinear(
        FFN,
        H,
        config=config,
        init_method=init_method_normal(0.5),
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )

    def block(x):
        hidden, _ = fc1(x)
        with get_cuda_rng_tracker().fork():  # heads differ per rank: so do their dropout masks
            hidden = F.dropout(F.gelu(hidden), p=0.3, training=True)
        out, _ = fc2(hidden)
        return F.dropout(out, p=0.3, training=True)  # replicated activations: the same mask on every TP rank

    g = torch.Generator().manual_seed(2)
    data, upstream = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    results = {}
    for mode in ("plain", "checkpoint", "distributed"):
        model_parallel_cuda_manual_seed(21)
        with get_cuda_rng_tracker().fork():  # the default TP rank comes from the groups
            assert torch.equal(torch.rand(2), _draws(21 + 2718 + tp_rank(), 2))
        model_parallel_cuda_manual_seed(21)
        fc1.zero_grad(set_to_none=True)
        fc2.zero_grad(set_to_none=True)
        x = data.clone().requires_grad_()
        if mode == "plain":
            out = block(x)
        else:
            saved_sizes = []

            def pack(tensor):
                saved_sizes.append(tensor.numel())
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = checkpoint(block, mode == "distributed", x)
            assert saved_sizes == [x.numel() // tp if mode == "distributed" else x.numel()], saved_sizes
            assert torch.equal(x, data)  # the caller's tensor is not modified
        (out * upstream).sum().backward()
        results[mode] = {
            "out": out.detach(),
            "x_grad": x.grad,
            "fc1_weight_grad": gather(fc1.weight.grad, 0),
            "fc2_weight_grad": gather(fc2.weight.grad, 1),
            "fc2_bias_grad": fc2.bias.grad,
        }

    with pytest.raises(
        TypeError,
        match="distribute_saved_activations=True splits the first argument across the "
        "tensor-parallel group, so it must be a tensor; got float",
    ):
        checkpoint(lambda scale, x: x * scale, True, 2.0, data.clone().requires_grad_())
    return results if dist.get_rank() == 0 else None


def test_checkpoint_with_and_without_distributed_saved_activations_matches_plain():
    results = run_distributed(2, _checkpointed_mlp_results, 2)[0]
    for mode in ("checkpoint", "distributed"):
        for name, expected in results["plain"].items():
            assert_rel_close(results[mode][name], expected, what=f"{mode} {name}")
