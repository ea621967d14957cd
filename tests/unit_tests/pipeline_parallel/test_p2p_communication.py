"""Point-to-point pipeline communication: every function against its partner, shapes, ordering, errors, hangs."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import DistributedTestError, Utils, run_distributed

SHAPE = (3, 2, 4)


def _config(**overrides):
    fields = dict(num_layers=2, hidden_size=4, num_attention_heads=1, pipeline_dtype=torch.float32)
    return TransformerConfig(**{**fields, **overrides})


def _tensor(tag: float, shape=SHAPE):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1000 * tag


def _two_stage_exchanges(batch_p2p_comm: bool):
    """Each pairing of functions between stage 0 and stage 1, in the order a 1F1B step uses them."""
    Utils.initialize_model_parallel(1, 2)
    config = _config(batch_p2p_comm=batch_p2p_comm)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    got = {}
    if rank == 0:
        got["recv_forward_on_first"] = p2p.recv_forward(SHAPE, config)
        p2p.send_forward(_tensor(1), config)
        got["grad"] = p2p.send_forward_recv_backward(_tensor(2), SHAPE, config)
        got["next_input_on_first"] = p2p.send_backward_recv_forward(_tensor(3), SHAPE, config)
        got["recv_backward"] = p2p.recv_backward(SHAPE, config)
    else:
        got["input"] = p2p.recv_forward(SHAPE, config)
        got["input_2"] = p2p.recv_forward(SHAPE, config)
        p2p.send_backward(_tensor(4), config)
        got["grad_on_last"] = p2p.send_forward_recv_backward(_tensor(5), SHAPE, config)
        p2p.send_backward(_tensor(6), config)
    return {k: (None if v is None else (v.detach().clone(), v.requires_grad)) for k, v in got.items()}


@pytest.mark.parametrize("batch_p2p_comm", [True, False])
def test_one_f_one_b_pairs(batch_p2p_comm):
    first, last = run_distributed(2, _two_stage_exchanges, batch_p2p_comm)
    # Nothing arrives before the first stage or after the last.
    assert first["recv_forward_on_first"] is None and first["next_input_on_first"] is None
    assert last["grad_on_last"] is None
    assert torch.equal(last["input"][0], _tensor(1)) and last["input"][1]  # activations require grad
    assert torch.equal(last["input_2"][0], _tensor(2))
    assert torch.equal(first["grad"][0], _tensor(4)) and not first["grad"][1]
    assert torch.equal(first["recv_backward"][0], _tensor(6))


def _ring_exchange(variable: bool):
    """Interleaved-style calls around a ring of 4: everyone sends both ways and receives both ways at once."""
    Utils.initialize_model_parallel(1, 4)
    config = _config(variable_seq_lengths=variable)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    shape = (2 + rank, 2, 4) if variable else SHAPE  # with variable lengths every rank sends its own length
    activation, grad = p2p.send_forward_backward_recv_forward_backward(
        _tensor(rank, shape), -_tensor(rank, shape), recv_prev=True, recv_next=True, tensor_shape=SHAPE, config=config
    )
    forward_only = p2p.send_forward_recv_forward(_tensor(10 + rank, shape), True, SHAPE, config)
    backward_only = p2p.send_backward_recv_backward(-_tensor(10 + rank, shape), True, SHAPE, config)
    return [t.detach() for t in (activation, grad, forward_only, backward_only)]


@pytest.mark.parametrize("variable", [False, True])
def test_ring_exchange_wraps_around(variable):
    results = run_distributed(4, _ring_exchange, variable)
    for rank, (activation, grad, forward_only, backward_only) in enumerate(results):
        prev, nxt = (rank - 1) % 4, (rank + 1) % 4
        prev_shape = (2 + prev, 2, 4) if variable else SHAPE
        next_shape = (2 + nxt, 2, 4) if variable else SHAPE
        assert torch.equal(activation, _tensor(prev, prev_shape))
        assert torch.equal(grad, -_tensor(nxt, next_shape))
        assert torch.equal(forward_only, _tensor(10 + prev, prev_shape))
        assert torch.equal(backward_only, -_tensor(10 + nxt, next_shape))


def _same_peer_both_directions():
    """With two stages the previous and next rank coincide: activation and gradient must not be swapped."""
    Utils.initialize_model_parallel(1, 2)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    config = _config()
    results = []
    for batch in (True, False):
        config.batch_p2p_comm = batch
        activation, grad = p2p.send_forward_backward_recv_forward_backward(
            _tensor(rank), -_tensor(rank), recv_prev=True, recv_next=True, tensor_shape=SHAPE, config=config
        )
        results.append((activation.detach(), grad))
    return results


def test_two_stages_keep_activation_and_gradient_apart():
    for rank, results in enumerate(run_distributed(2, _same_peer_both_directions)):
        other = 1 - rank
        for activation, grad in results:
            assert torch.equal(activation, _tensor(other))
            assert torch.equal(grad, -_tensor(other))


def _both_stages_wait_to_receive():
    Utils.initialize_model_parallel(1, 2)
    config = _config()
    if parallel_state.get_pipeline_model_parallel_rank() == 0:
        p2p.recv_backward(SHAPE, config)  # stage 1 never sends a gradient...
    else:
        p2p.recv_forward(SHAPE, config)  # ...and stage 0 never sends an activation
    return "done"


def test_a_hang_fails_and_names_the_rank():
    with pytest.raises(DistributedTestError, match=r"rank [01] failed|ranks \[0, 1\] did not finish"):
        run_distributed(2, _both_stages_wait_to_receive, timeout=3)


# ---- errors, raised before anything is posted (so no peer is left waiting on a half-made call) -------------------


def test_pipeline_dtype_is_required():
    config = _config()
    config.pipeline_dtype = None
    with pytest.raises(ValueError, match="config.pipeline_dtype is None"):
        p2p.send_forward(_tensor(0), config, is_last_stage=False)


def test_ring_exchange_kernel_is_rejected():
    with pytest.raises(ValueError, match="use_ring_exchange_p2p=True needs a custom ring-exchange kernel"):
        p2p.recv_forward(SHAPE, _config(use_ring_exchange_p2p=True), is_first_stage=False)


def test_sent_dtype_must_be_pipeline_dtype():
    with pytest.raises(ValueError, match="activation sent to the next stage has dtype torch.float64"):
        p2p.send_forward(_tensor(0).double(), _config(), is_last_stage=False)


def test_sent_shape_must_match_unless_lengths_vary():
    with pytest.raises(ValueError, match=r"has shape \(3, 2, 4\) but the pipeline expects \(5, 2, 4\).*variable_seq"):
        p2p.send_forward_recv_backward(_tensor(0), (5, 2, 4), _config(), is_last_stage=False)
    with pytest.raises(ValueError, match=r"gradient sent to the previous stage has 2 dimensions \(6, 4\)"):
        p2p.send_backward_recv_forward(
            _tensor(0, (6, 4)), SHAPE, _config(variable_seq_lengths=True), is_first_stage=False
        )


def test_single_direction_functions_do_nothing_at_the_ends():
    config = _config()
    assert p2p.recv_forward(SHAPE, config, is_first_stage=True) is None
    assert p2p.recv_backward(SHAPE, config, is_last_stage=True) is None
    assert p2p.send_forward(_tensor(0), config, is_last_stage=True) is None
    assert p2p.send_backward(_tensor(0), config, is_first_stage=True) is None
    assert not dist.is_initialized()  # nothing tried to communicate
