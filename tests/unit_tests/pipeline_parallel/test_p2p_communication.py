"""Point-to-point pipeline communication (P2PCommunicator): every method against its partner, shapes, ordering,
errors, hangs."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, is_single_shape
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import DistributedTestError, Utils, run_distributed

SHAPE = (3, 2, 4)


def _config(**overrides):
    fields = dict(num_layers=2, hidden_size=4, num_attention_heads=1, pipeline_dtype=torch.float32)
    return TransformerConfig(**{**fields, **overrides})


def _tensor(tag: float, shape=SHAPE):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1000 * tag


def _communicator(config):
    return P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)


def _two_stage_exchanges(batch_p2p_comm: bool):
    """Each pairing of methods between stage 0 and stage 1, in the order a 1F1B step uses them."""
    Utils.initialize_model_parallel(1, 2)
    p2p = _communicator(_config(batch_p2p_comm=batch_p2p_comm))
    first, last = p2p.is_pp_first_stage, p2p.is_pp_last_stage
    got = {"stage": (p2p.current_stage, p2p.total_stages, first, last)}
    if first:
        got["recv_forward_on_first"] = p2p.recv_forward(SHAPE, first)
        p2p.send_forward(_tensor(1), last)
        got["grad"] = p2p.send_forward_recv_backward(_tensor(2), SHAPE, last)
        got["next_input_on_first"] = p2p.send_backward_recv_forward(_tensor(3), SHAPE, first)
        got["recv_backward"] = p2p.recv_backward(SHAPE, last)
        # Lists of shapes answer with lists; a None shape is skipped.
        got["listed_grads"] = p2p.send_forward_recv_backward([_tensor(7), None], [SHAPE, None], last)
    else:
        got["input"] = p2p.recv_forward(SHAPE, first)
        got["input_2"] = p2p.recv_forward(SHAPE, first)
        p2p.send_backward(_tensor(4), first)
        got["grad_on_last"] = p2p.send_forward_recv_backward(_tensor(5), SHAPE, last)
        p2p.send_backward(_tensor(6), first)
        got["listed_inputs"] = p2p.recv_forward([SHAPE, None], first)
        p2p.send_backward([_tensor(8)], first)
        # The ends' own directions do nothing (a call here would hang: the other stage posts nothing more).
        got["ends"] = (p2p.recv_backward([SHAPE], last), p2p.send_forward(_tensor(0), last))

    def plain(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone(), v.requires_grad
        return [plain(x) for x in v] if isinstance(v, list) else v

    return {k: plain(v) for k, v in got.items()}


@pytest.mark.parametrize("batch_p2p_comm", [True, False])
def test_one_f_one_b_pairs(batch_p2p_comm):
    first, last = run_distributed(2, _two_stage_exchanges, batch_p2p_comm)
    assert first["stage"] == (0, 2, True, False) and last["stage"] == (1, 2, False, True)
    # Nothing arrives before the first stage or after the last.
    assert first["recv_forward_on_first"] is None and first["next_input_on_first"] is None
    assert last["grad_on_last"] is None
    assert torch.equal(last["input"][0], _tensor(1)) and last["input"][1]  # activations require grad
    assert torch.equal(last["input_2"][0], _tensor(2))
    assert torch.equal(first["grad"][0], _tensor(4)) and not first["grad"][1]
    assert torch.equal(first["recv_backward"][0], _tensor(6))
    assert torch.equal(last["listed_inputs"][0][0], _tensor(7)) and last["listed_inputs"][1] is None
    assert torch.equal(first["listed_grads"][0][0], _tensor(8)) and first["listed_grads"][1] is None
    assert last["ends"] == ([None], None)


def test_is_single_shape():
    assert is_single_shape(torch.Size([3, 2])) and is_single_shape([3, 2, 4]) and is_single_shape((3, 2))
    assert not is_single_shape([(3, 2), (3, 2)]) and not is_single_shape([torch.Size([3])])
    assert not is_single_shape(None) and not is_single_shape([None])


def _ring_exchange(variable: bool):
    """Interleaved-style calls around a ring of 4: everyone sends both ways and receives both ways at once."""
    Utils.initialize_model_parallel(1, 4)
    p2p = _communicator(_config(variable_seq_lengths=variable))
    rank = p2p.current_stage
    shape = (2 + rank, 2, 4) if variable else SHAPE  # with variable lengths every rank sends its own length
    activation, grad = p2p.send_forward_backward_recv_forward_backward(
        _tensor(rank, shape), -_tensor(rank, shape), recv_prev=True, recv_next=True, tensor_shape=SHAPE
    )
    forward_only = p2p.send_forward_recv_forward(_tensor(10 + rank, shape), True, SHAPE)
    backward_only, requests = p2p.send_backward_recv_backward(
        -_tensor(10 + rank, shape), True, SHAPE, overlap_p2p_comm=True
    )
    for request in requests:  # overlap_p2p_comm hands back the requests instead of waiting
        request.wait()
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
    config = _config()
    p2p = _communicator(config)
    rank = p2p.current_stage
    results = []
    for batch in (True, False):
        config.batch_p2p_comm = batch
        activation, grad = p2p.send_forward_backward_recv_forward_backward(
            _tensor(rank), -_tensor(rank), recv_prev=True, recv_next=True, tensor_shape=SHAPE
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
    p2p = _communicator(_config())
    if p2p.is_pp_first_stage:
        p2p.recv_backward(SHAPE, is_last_stage=False)  # stage 1 never sends a gradient...
    else:
        p2p.recv_forward(SHAPE, is_first_stage=False)  # ...and stage 0 never sends an activation
    return "done"


def test_a_hang_fails_and_names_the_rank():
    with pytest.raises(DistributedTestError, match=r"rank [01] failed|ranks \[0, 1\] did not finish"):
        run_distributed(2, _both_stages_wait_to_receive, timeout=3)


# ---- errors, raised before anything is posted (so no peer is left waiting on a half-made call) -------------------
# The group is never asked for ranks before these checks, so a communicator without a real group suffices.


def _unconnected(**overrides):
    return P2PCommunicator(pp_group=None, config=_config(**overrides))


def test_pipeline_dtype_is_required():
    p2p = _unconnected()
    p2p.config.pipeline_dtype = None
    with pytest.raises(ValueError, match="config.pipeline_dtype is None"):
        p2p.send_forward(_tensor(0), is_last_stage=False)


def test_ring_exchange_kernel_is_rejected():
    with pytest.raises(ValueError, match="use_ring_exchange_p2p=True needs a custom ring-exchange kernel"):
        _unconnected(use_ring_exchange_p2p=True).recv_forward(SHAPE, is_first_stage=False)


def test_sent_dtype_must_be_pipeline_dtype():
    with pytest.raises(ValueError, match="activation sent to the next stage has dtype torch.float64"):
        _unconnected().send_forward(_tensor(0).double(), is_last_stage=False)


def test_sent_shape_must_match_unless_lengths_vary():
    with pytest.raises(ValueError, match=r"has shape \(3, 2, 4\) but the pipeline expects \(5, 2, 4\).*variable_seq"):
        _unconnected().send_forward_recv_backward(_tensor(0), (5, 2, 4), is_last_stage=False)
    with pytest.raises(ValueError, match=r"gradient sent to the previous stage has 2 dimensions \(6, 4\)"):
        _unconnected(variable_seq_lengths=True).send_backward_recv_forward(
            _tensor(0, (6, 4)), SHAPE, is_first_stage=False
        )


def test_single_direction_methods_do_nothing_at_the_ends():
    p2p = _unconnected()
    assert p2p.recv_forward(SHAPE, is_first_stage=True) is None
    assert p2p.recv_backward([SHAPE, SHAPE], is_last_stage=True) == [None, None]
    assert p2p.send_forward(_tensor(0), is_last_stage=True) is None
    assert p2p.send_backward(_tensor(0), is_first_stage=True) is None
    assert p2p.send_forward_recv_backward(_tensor(0), SHAPE, is_last_stage=True) is None
    assert p2p.send_backward_recv_forward(_tensor(0), SHAPE, is_first_stage=True) is None
    assert not dist.is_initialized()  # nothing tried to communicate
