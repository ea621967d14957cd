"""The schedules on a tiny residual MLP: equivalence with one stage, documented pass order, hooks, memory, errors.

Scenarios that share a world size run in one multi-rank job (see ``_run_scenarios``); the single-stage reference
runs in the test process itself (no communication needed).
"""

import contextlib
import types

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import (
    deallocate_output_tensor,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    get_tensor_shapes,
)
from tests.unit_tests.pipeline_parallel import toy_pipeline as toy
from tests.unit_tests.test_utilities import Utils, run_distributed

SEQ, MBS = 4, 2

# name: (world size = pp, vp, num_layers, num_microbatches, config overrides, options)
SCENARIOS = {
    "1f1b_pp2_m1": (2, None, 4, 1, {}, {}),
    "1f1b_pp2_m5": (2, None, 4, 5, {}, {}),
    "1f1b_pp2_unbatched_dealloc": (2, None, 4, 3, {"batch_p2p_comm": False, "deallocate_pipeline_outputs": True}, {}),
    "1f1b_pp2_varlen": (2, None, 4, 4, {"variable_seq_lengths": True}, {"seq_lengths": [3, 6, 2, 5]}),
    "1f1b_pp2_legacy_loss": (2, None, 2, 3, {}, {"legacy": True}),
    "1f1b_pp2_per_token": (2, None, 4, 3, {"calculate_per_token_loss": True}, {"finalize": True}),
    "1f1b_pp4_m2": (4, None, 4, 2, {}, {}),
    "1f1b_pp4_m6": (4, None, 8, 6, {}, {}),
    "vpp2_pp2_m2": (2, 2, 4, 2, {}, {}),
    "vpp2_pp2_m4": (2, 2, 4, 4, {}, {}),
    "vpp2_pp2_m6_dealloc": (2, 2, 8, 6, {"deallocate_pipeline_outputs": True}, {}),
    "vpp2_pp2_overlap_varlen": (
        2,
        2,
        4,
        4,
        {"overlap_p2p_comm": True, "batch_p2p_comm": False, "variable_seq_lengths": True},
        {"seq_lengths": [5, 2, 3, 4]},
    ),
    "vpp3_pp2_group3_m5": (2, 3, 6, 5, {"microbatch_group_size_per_vp_stage": 3}, {}),
    "vpp2_pp2_per_token": (2, 2, 4, 4, {"calculate_per_token_loss": True}, {"finalize": True}),
    "vpp2_pp4_m4": (4, 2, 8, 4, {}, {}),
    "vpp2_pp4_m8_overlap": (4, 2, 8, 8, {"overlap_p2p_comm": True, "batch_p2p_comm": False}, {}),
}


def _forward_backward(chunks, config, batches, num_microbatches, options, forward_only=False, outputs=None):
    return get_forward_backward_func()(
        forward_step_func=toy.forward_step_func(options.get("legacy", False), outputs),
        data_iterator=toy.iterators(batches, len(chunks)),
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=forward_only,
    )


def _run_scenarios(names):
    results = {}
    for name in names:
        pp, vp, num_layers, num_microbatches, overrides, options = SCENARIOS[name]
        Utils.initialize_model_parallel(1, pp, vp)
        if options.get("finalize"):
            overrides = {**overrides, "finalize_model_grads_func": finalize_model_grads}
        config = toy.toy_config(num_layers, pp, vp, **overrides)
        chunks = toy.build_chunks(config)
        batches = toy.make_microbatches(num_microbatches, options.get("seq_lengths"))
        toy.TRACE.clear()
        outputs = []
        losses = _forward_backward(chunks, config, batches, num_microbatches, options, outputs=outputs)
        trace = list(toy.TRACE)
        # Sent activations keep only one element of storage when deallocate_pipeline_outputs is on.
        forwards = [chunk for kind, _, chunk in trace if kind == "F"]
        sent = [o for o, chunk in zip(outputs, forwards) if not chunks[chunk].post_process]
        storage = sorted({o.untyped_storage().nbytes() for o in sent})
        grads = toy.gather_grads(chunks)
        outputs.clear()
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        eval_losses = _forward_backward(chunks, config, batches, num_microbatches, options, True, outputs)
        results[name] = {
            "losses": losses,
            "trace": trace,
            "grads": grads,
            "sent_storage_bytes": storage,
            "forward_only_losses": eval_losses,
            "forward_only_builds_graph": any(o.requires_grad for o in outputs),
            "forward_only_grads": [p.grad for c in chunks for p in c.parameters() if p.grad is not None],
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        }
    return results


def _reference(name):
    _, _, num_layers, num_microbatches, overrides, options = SCENARIOS[name]
    config = toy.toy_config(num_layers, **{k: v for k, v in overrides.items() if k == "calculate_per_token_loss"})
    if options.get("finalize"):
        config.finalize_model_grads_func = _divide_by_tokens
    model = toy.ToyChunk(config, toy.full_layers(num_layers), 0, True, True)
    batches = toy.make_microbatches(num_microbatches, options.get("seq_lengths"))
    losses = forward_backward_no_pipelining(
        forward_step_func=toy.forward_step_func(options.get("legacy", False)),
        data_iterator=iter(batches),
        model=model,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    return losses, model.global_grads()


def _divide_by_tokens(model, num_tokens, pg_collection=None, force_all_reduce=False):
    for chunk in model:
        for param in chunk.parameters():
            param.grad /= num_tokens


@pytest.fixture(scope="module")
def runs():
    results = {}
    for world_size in (2, 4):
        names = [n for n, s in SCENARIOS.items() if s[0] == world_size]
        for rank_results in run_distributed(world_size, _run_scenarios, names, timeout=240):
            for name, result in rank_results.items():
                results.setdefault(name, []).append(result)
    return results


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_schedule_matches_single_stage(runs, name):
    expected_losses, expected_grads = _reference(name)
    pp = SCENARIOS[name][0]
    for rank, result in enumerate(runs[name]):
        if rank == pp - 1:
            assert len(result["losses"]) == len(expected_losses)
            for got, want in zip(result["losses"], expected_losses):
                assert torch.allclose(got["loss"], want["loss"], rtol=1e-6, atol=0)
        else:
            assert result["losses"] == []
        assert sorted(result["grads"]) == sorted(expected_grads)
        for layer, (weight_grad, bias_grad) in expected_grads.items():
            assert _relative(result["grads"][layer][0], weight_grad) <= 1e-5, f"rank {rank} layer {layer} weight"
            assert _relative(result["grads"][layer][1], bias_grad) <= 1e-5, f"rank {rank} layer {layer} bias"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_forward_only_returns_same_losses_and_builds_no_graph(runs, name):
    for result in runs[name]:
        assert len(result["forward_only_losses"]) == len(result["losses"])
        for got, want in zip(result["forward_only_losses"], result["losses"]):
            assert torch.equal(got["loss"], want["loss"])
        assert not result["forward_only_builds_graph"]
        assert result["forward_only_grads"] == []


def _one_f_one_b_order(pp_rank, pp_size, m):
    """1F1B as published: p - r - 1 warm-up forwards, alternate F and B, then the remaining backwards."""
    warmup = min(pp_size - pp_rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def test_1f1b_trace_is_the_documented_order(runs):
    # Written out for p=4, m=6 so the expectation does not depend on the helper above.
    expected = [
        ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"],
        ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "B4", "B5"],
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "F5", "B4", "B5"],
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"],
    ]
    got = [[f"{kind}{mb}" for kind, mb, _ in r["trace"]] for r in runs["1f1b_pp4_m6"]]
    assert got == expected
    for name in ("1f1b_pp2_m1", "1f1b_pp2_m5", "1f1b_pp4_m2"):
        pp, _, _, m, _, _ = SCENARIOS[name]
        for rank, result in enumerate(runs[name]):
            assert [(kind, mb) for kind, mb, _ in result["trace"]] == _one_f_one_b_order(rank, pp, m)


def test_1f1b_keeps_at_most_p_minus_r_microbatches_in_flight(runs):
    for rank, result in enumerate(runs["1f1b_pp4_m6"]):
        in_flight, peak = 0, 0
        for kind, _, _ in result["trace"]:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == 4 - rank


def test_interleaved_trace_is_the_documented_order(runs):
    # p=2, v=2, m=4 (groups of 2): rank 0 warms up with 2*(p-1) + (v-1)*2 = 4 forwards, rank 1 with 2.
    # Entries are pass, micro-batch, model chunk; backward passes visit the chunks in reverse.
    expected = [
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0".split(),
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0".split(),
    ]
    got = [[f"{kind}{mb}.{chunk}" for kind, mb, chunk in r["trace"]] for r in runs["vpp2_pp2_m4"]]
    assert got == expected


def test_deallocated_outputs_keep_one_element(runs):
    cases = (("1f1b_pp2_unbatched_dealloc", True), ("vpp2_pp2_m6_dealloc", True), ("vpp2_pp2_m4", False))
    for name, deallocated in cases:
        for result in runs[name]:
            if not result["sent_storage_bytes"]:
                continue  # the last stage sends nothing (1F1B)
            if deallocated:
                assert result["sent_storage_bytes"] == [4]
            else:
                assert min(result["sent_storage_bytes"]) == SEQ * MBS * toy.HIDDEN * 4


# ---- hooks on a single stage (no communication needed) ----------------------------------------------------------


def _single_stage(**overrides):
    config = toy.toy_config(2, **overrides)
    return toy.ToyChunk(config, toy.full_layers(2), 0, True, True), config


def _run_single(model, num_microbatches=3, **kwargs):
    return forward_backward_no_pipelining(
        forward_step_func=toy.forward_step_func(kwargs.pop("legacy", False)),
        data_iterator=iter(toy.make_microbatches(num_microbatches)),
        model=model,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
        **kwargs,
    )


def test_grad_scale_func_scales_the_loss_before_backward():
    plain, _ = _single_stage()
    _run_single(plain)
    scaled, config = _single_stage(grad_scale_func=lambda loss: loss * 8)
    _run_single(scaled)
    for (w, b), (sw, sb) in zip(plain.global_grads().values(), scaled.global_grads().values()):
        assert torch.allclose(sw, 8 * w) and torch.allclose(sb, 8 * b)


def test_no_sync_is_held_for_all_but_the_last_microbatch_and_finalize_runs_once():
    events = []

    @contextlib.contextmanager
    def no_sync():
        events.append("enter")
        yield
        events.append("exit")

    model, config = _single_stage(
        no_sync_func=no_sync,
        finalize_model_grads_func=lambda chunks, num_tokens, pg_collection, force_all_reduce: events.append(
            ("finalize", len(chunks), num_tokens, force_all_reduce)
        ),
    )
    _run_single(model, num_microbatches=3)
    # The no_sync context wraps micro-batches 0 and 1; micro-batch 2's backward runs with reduction enabled.
    assert events == ["enter", "exit", ("finalize", 1, None, False)]
    events.clear()
    _run_single(model, num_microbatches=1, force_all_reduce=True)
    assert events == [("finalize", 1, None, True)]  # the schedule hands force_all_reduce on


def test_per_token_loss_hands_the_token_count_to_finalize():
    seen = []
    model, _ = _single_stage(
        calculate_per_token_loss=True, finalize_model_grads_func=lambda chunks, num_tokens, **_: seen.append(num_tokens)
    )
    losses = _run_single(model)
    assert seen[0] == sum(int(entry["loss"][1]) for entry in losses)


def test_legacy_loss_is_averaged_over_microbatches():
    model, _ = _single_stage()
    losses = _run_single(model, legacy=True)
    batches = toy.make_microbatches(3)
    for loss, batch in zip(losses, batches):
        model.zero_grad()
        output = model(batch["x"], batch["id"])
        per_token = ((output - batch["target"]) ** 2).sum(-1) * batch["mask"]
        assert torch.allclose(loss["loss"], per_token.sum() / batch["mask"].sum())


def test_collect_non_loss_data_returns_what_loss_func_collects():
    model, _ = _single_stage()
    collected = _run_single(model, forward_only=True, collect_non_loss_data=True)
    assert len(collected) == 3 and all(set(c) == {"mean output"} for c in collected)


def test_first_microbatch_is_announced_to_the_model():
    model, _ = _single_stage()
    calls = []
    model.set_is_first_microbatch = lambda: calls.append(True)
    _run_single(model, num_microbatches=3)
    assert calls == [True]
    _run_single(model, num_microbatches=2, forward_only=True, first_val_step=False)
    assert calls == [True]


def test_get_forward_backward_func_picks_the_schedule():
    assert get_forward_backward_func(1, None) is forward_backward_no_pipelining
    assert get_forward_backward_func(2, None) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, 2) is forward_backward_pipelining_with_interleaving
    assert get_forward_backward_func() is forward_backward_no_pipelining  # nothing initialised: one stage


def test_tensor_shapes_split_the_sequence_under_sequence_parallelism():
    config = toy.toy_config(2)
    assert get_tensor_shapes(seq_length=16, micro_batch_size=2, decoder_seq_length=None, config=config) == [(16, 2, 8)]
    parallel_state.set_tensor_model_parallel_world_size(4)
    try:
        config = toy.toy_config(2, tensor_model_parallel_size=4, sequence_parallel=True, num_attention_heads=4)
        shapes = get_tensor_shapes(seq_length=16, micro_batch_size=2, decoder_seq_length=None, config=config)
    finally:
        parallel_state.set_tensor_model_parallel_world_size(None)
    assert shapes == [(4, 2, 8)]


# ---- errors --------------------------------------------------------------------------------------------------------


def _call(schedule, model, data_iterator=None, num_microbatches=2, **kwargs):
    return schedule(
        forward_step_func=toy.forward_step_func(),
        data_iterator=data_iterator if data_iterator is not None else iter(toy.make_microbatches(2)),
        model=model,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
        **kwargs,
    )


def test_schedule_argument_errors():
    model, _ = _single_stage()
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer, got 0"):
        _call(forward_backward_no_pipelining, model, num_microbatches=0)
    with pytest.raises(ValueError, match="takes one model chunk, got a list of 2"):
        _call(forward_backward_pipelining_without_interleaving, [model, model])
    with pytest.raises(ValueError, match="takes one data iterator, got a list of 2"):
        _call(forward_backward_no_pipelining, model, data_iterator=[iter([]), iter([])])
    overlapping, _ = _single_stage(overlap_p2p_comm=True)
    with pytest.raises(ValueError, match="overlap_p2p_comm=True is only supported by the interleaved schedule"):
        _call(forward_backward_pipelining_without_interleaving, overlapping)
    with pytest.raises(TypeError, match="expects model to be a list of model chunks"):
        _call(forward_backward_pipelining_with_interleaving, model)
    with pytest.raises(TypeError, match="one iterator \\(or None\\) per model chunk"):
        _call(forward_backward_pipelining_with_interleaving, [model, model], data_iterator=[iter([])])
    with pytest.raises(ValueError, match="needs pipeline_model_parallel_size > 1 \\(got 1\\)"):
        _call(forward_backward_pipelining_with_interleaving, [model], data_iterator=[iter([])])


def test_interleaved_rejects_overlap_with_batching():
    parallel_state.set_pipeline_model_parallel_world_size(2)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    try:
        model, _ = _single_stage(overlap_p2p_comm=True, batch_p2p_comm=True)
        with pytest.raises(ValueError, match="overlap_p2p_comm=True and batch_p2p_comm=True cannot be combined"):
            _call(forward_backward_pipelining_with_interleaving, [model, model], [iter([]), iter([])])
    finally:
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def test_loss_func_must_return_two_or_three_values():
    model, _ = _single_stage()

    def bad_step(data_iterator, model):
        batch = next(data_iterator)
        return model(batch["x"], batch["id"]), lambda output: output.sum()

    with pytest.raises(ValueError, match="loss_func must return \\(loss, num_tokens, reduced_dict\\)"):
        forward_backward_no_pipelining(
            forward_step_func=bad_step,
            data_iterator=iter(toy.make_microbatches(1)),
            model=model,
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )


def test_unsupported_step_options_are_rejected():
    model, config = _single_stage(num_microbatches_with_partial_activation_checkpoints=1)
    with pytest.raises(ValueError, match="num_microbatches_with_partial_activation_checkpoints=1 is not supported"):
        _call(forward_backward_no_pipelining, model)
    model, config = _single_stage(defer_embedding_wgrad_compute=True)
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute=True needs deferred output-layer"):
        _call(forward_backward_no_pipelining, model)
    model, config = _single_stage()
    with pytest.raises(ValueError, match="checkpoint_activations_microbatch .* is not supported"):
        schedules.forward_step(toy.forward_step_func(), iter([]), model, 1, None, [], config, 1, False, True)


def test_deallocating_a_view_is_an_error():
    base = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="view of another tensor"):
        deallocate_output_tensor(base[1:], deallocate_pipeline_outputs=True)
    view = base[1:]
    deallocate_output_tensor(view, deallocate_pipeline_outputs=False)  # off: nothing happens
    assert view.shape == (3, 4)


# ---- Megatron's helper functions -----------------------------------------------------------------------------------


class _Sized:
    """Stands in for a process group where only the size is read."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_tensor_shapes_use_explicit_groups():
    config = types.SimpleNamespace(sequence_parallel=True, hidden_size=8)  # all get_tensor_shapes reads
    shapes = get_tensor_shapes(
        seq_length=16,
        micro_batch_size=2,
        decoder_seq_length=None,
        config=config,
        tp_group=_Sized(2),
        cp_group=_Sized(4),
    )
    assert shapes == [(2, 2, 8)]  # 16 / cp 4 / tp 2


def test_custom_backward_ignores_the_freed_output_shape():
    weight = torch.randn(3, requires_grad=True)
    output = weight * 2
    output.data = torch.empty((1,))  # what a freed stage output looks like in Megatron
    with pytest.raises(RuntimeError):
        torch.autograd.backward(output, grad_tensors=torch.ones(3), retain_graph=True)
    schedules.custom_backward(output, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(weight.grad, torch.tensor([2.0, 4.0, 6.0]))
    loss = (weight * weight).sum()
    weight.grad = None
    schedules.custom_backward(loss, None)  # a scalar loss gets gradient one
    assert torch.allclose(weight.grad, 2 * weight.detach())
    with pytest.raises(ValueError, match="a gradient is needed for a non-scalar output"):
        schedules.custom_backward(weight * 3, None)


def test_backward_step_goes_through_custom_backward_when_outputs_are_freed():
    model, config = _single_stage(deallocate_pipeline_outputs=True)
    x = torch.randn(2, 3, requires_grad=True)
    output = x * 5
    deallocate_output_tensor(output, True)
    grad = schedules.backward_step(x, output, torch.ones(2, 3), config)
    assert torch.equal(grad, torch.full((2, 3), 5.0))


def test_get_tensor_device():
    assert schedules.get_tensor_device(torch.zeros(1)) == torch.device("cpu")
    assert schedules.get_tensor_device({"vision": torch.zeros(1), "text": torch.zeros(2)}) == torch.device("cpu")
    with pytest.raises(ValueError, match="empty dict"):
        schedules.get_tensor_device({})


def test_forward_step_calc_loss_scales_as_megatron():
    _, config = _single_stage()
    store = []
    loss = torch.tensor(6.0)
    # Legacy (loss, dict): times the context-parallel size, over the micro-batches.
    out, tokens = schedules.forward_step_calc_loss(
        None, loss, lambda o: (o, {"l": o}), config, None, False, 3, store, cp_group_size=2, is_last_stage=True
    )
    assert out.item() == pytest.approx(4.0) and tokens.item() == 0 and store == [{"l": loss}]
    # (loss, num_tokens, dict): over the tokens and the micro-batches.
    out, tokens = schedules.forward_step_calc_loss(
        None,
        loss,
        lambda o: (o, torch.tensor(4), {}),
        config,
        None,
        False,
        3,
        store,
        cp_group_size=2,
        is_last_stage=True,
    )
    assert out.item() == pytest.approx(0.5) and tokens.item() == 4
    # Off the last stage the output passes through untouched.
    out, tokens = schedules.forward_step_calc_loss(
        None, loss, None, config, None, False, 3, store, cp_group_size=2, is_last_stage=False
    )
    assert out is loss and tokens.item() == 0 and len(store) == 2


def test_get_forward_backward_func_refuses_multi_module_schedules():
    with pytest.raises(ValueError, match=r"not supported yet: multi-module pipeline schedules"):
        get_forward_backward_func(pp_size=2, schedule_pg_collection=object())


def test_adjust_tensor_shapes_fn_is_refused_where_nothing_is_exchanged():
    model, _ = _single_stage()
    with pytest.raises(ValueError, match="adjust_tensor_shapes_fn is not supported by forward_backward_no_pipelining"):
        _call(forward_backward_no_pipelining, model, adjust_tensor_shapes_fn=lambda r, s: (r, s))


def _one_f_one_b_with_explicit_groups():
    """1F1B given pg_collection, a P2PCommunicator and an adjust_tensor_shapes_fn, against the defaults."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    Utils.initialize_model_parallel(1, 2)
    config = toy.toy_config(4, 2)
    chunks = toy.build_chunks(config)
    batches = toy.make_microbatches(3)
    seen = []

    def adjust(recv_shapes, send_shapes):
        seen.append((list(recv_shapes), list(send_shapes)))
        return recv_shapes, send_shapes

    def run(**kwargs):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        losses = forward_backward_pipelining_without_interleaving(
            forward_step_func=toy.forward_step_func(),
            data_iterator=toy.iterators(batches, 1),
            model=chunks,
            num_microbatches=3,
            seq_length=SEQ,
            micro_batch_size=MBS,
            **kwargs,
        )
        return losses, toy.gather_grads(chunks)

    default = run()
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "pp"])
    explicit = run(
        pg_collection=pgs,
        p2p_communicator=P2PCommunicator(pp_group=pgs.pp, config=config),
        adjust_tensor_shapes_fn=adjust,
    )
    error = None
    try:
        run(adjust_tensor_shapes_fn=lambda r, s: (r + r, s))
    except ValueError as e:
        error = str(e)
    return default, explicit, seen, error


def test_1f1b_with_explicit_groups_and_shape_adjustment():
    for default, explicit, seen, error in run_distributed(2, _one_f_one_b_with_explicit_groups):
        assert len(default[0]) == len(explicit[0])
        for a, b in zip(default[0], explicit[0]):
            assert all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a.values(), b.values()))
        assert default[1].keys() == explicit[1].keys()
        assert all(torch.equal(a, b) for k in default[1] for a, b in zip(default[1][k], explicit[1][k]))
        assert seen == [([(SEQ, MBS, 8)], [(SEQ, MBS, 8)])]
        assert "adjust_tensor_shapes_fn must return one receive shape" in error


def test_backward_step_multimodule_returns_input_grads_per_module():
    _, config = _single_stage(grad_scale_func=lambda loss: loss * 10)
    vision_in = torch.ones(2, requires_grad=True)
    text_in = torch.ones(3, requires_grad=True)
    # Middle stage: every module's output gets the gradient the next stage sent for it.
    grads = schedules.backward_step_multimodule(
        {"vision": [vision_in], "text": text_in},
        {"vision": vision_in * 2, "text": [text_in * 3]},
        {"vision": torch.ones(2), "text": [torch.full((3,), 2.0)]},
        config,
        "text",
    )
    assert torch.equal(grads["vision"], torch.full((2,), 2.0)) and torch.equal(grads["text"], torch.full((3,), 6.0))
    # Last stage: the loss belongs to the language model and is scaled first.
    vision_in.grad = text_in.grad = None
    loss = (vision_in * 4).sum() + text_in.sum()
    grads = schedules.backward_step_multimodule({"vision": vision_in, "text": text_in}, loss, None, config, "text")
    assert torch.equal(grads["vision"], torch.full((2,), 40.0)) and torch.equal(grads["text"], torch.full((3,), 10.0))


@pytest.mark.parametrize("per_token, grad_scale, expected", [(False, None, 0.25), (False, 8.0, 2.0), (True, 8.0, 8.0)])
def test_forward_step_sets_the_moe_aux_loss_scale_on_every_stage(per_token, grad_scale, expected):
    """As Megatron: the aux losses' gradient scale is the loss scale over the micro-batches (not divided with
    per-token loss, whose division by the token count comes later), set on every pipeline stage."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    config = types.SimpleNamespace(
        num_moe_experts=4,
        calculate_per_token_loss=per_token,
        grad_scale_func=None if grad_scale is None else (lambda ones: ones * grad_scale),
    )
    for is_last_stage in (False, True):
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(123.0))
        schedules.forward_step_calc_loss(
            None,
            torch.tensor(1.0),
            lambda o: (o, torch.tensor(1), {}),
            config,
            None,
            False,
            4,
            [],
            cp_group_size=1,
            is_last_stage=is_last_stage,
        )
        assert MoEAuxLossAutoScaler.main_loss_backward_scale.item() == pytest.approx(expected), is_last_stage
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
