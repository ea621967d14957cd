"""Hybrid models with MoE layers ('E'): the layer is a pre-norm MoELayer built from the config's MoE fields, its
checkpoint keys are Megatron's (``pre_mlp_layernorm.weight``, grouped experts by global index), and the model at
EP=2 and at TP2 x EP2 with sequence parallelism equals one process over the same global batch (loss, every
gradient, the logged aux losses), as it does split over two pipeline stages by '|'; a checkpoint saved at PP=2
loads at one rank and at EP=2."""

import pytest
import torch

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from tests.unit_tests.models.hybrid.hybrid_test_helpers import (
    BATCH,
    SEQ,
    VOCAB,
    assert_close_dicts,
    build_config,
    build_model,
    checkpoint_space,
    relative_error,
    run_pipeline,
)
from tests.unit_tests.test_utilities import run_distributed
from tests.unit_tests.transformer.moe.moe_test_helpers import fresh_moe_state, reduced_tracker

PATTERN = "M*E-"
MOE_FIELDS = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
    moe_aux_loss_coeff=0.01,
    moe_z_loss_coeff=1e-3,
    moe_token_dispatcher_type="alltoall",
)


def _model(tp=1, ep=1, pattern=PATTERN, **overrides):
    fresh_moe_state()
    torch.manual_seed(1234)
    return build_model(tp, sp=tp > 1, ep=ep, pattern=pattern, seed=1234, config_overrides={**MOE_FIELDS, **overrides})


def _batches(count):
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        )
        for _ in range(count)
    ]


def _step(model, tokens, labels):
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    loss = model(tokens, position_ids, None, labels=labels).mean()
    loss.backward()
    return loss.item()


def _reference(num_batches):
    model = _model()
    kinds = [type(getattr(layer, "mlp", None)).__name__ for layer in model.decoder.layers]
    losses = [_step(model, tokens, labels) for tokens, labels in _batches(num_batches)]
    grads = checkpoint_space(model, gradients=True)
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    tracker = {name: values / num_batches for name, values in reduced_tracker().items()}
    return kinds, losses, grads, missing, tracker


def _parallel(tp, ep, num_batches):
    model = _model(tp, ep)
    tokens, labels = _batches(num_batches)[parallel_state.get_data_parallel_rank()]
    loss = _step(model, tokens, labels)
    # DDP's reduction by hand: dense gradients summed over data-parallel ranks, experts' over expert-DP ranks; the
    # checkpoint space then assembles TP shards, Mamba in_proj pieces and experts by global index.
    for param in model.parameters():
        dense = getattr(param, "allreduce", True)
        group = parallel_state.get_data_parallel_group() if dense else parallel_state.get_expert_data_parallel_group()
        torch.distributed.all_reduce(param.grad, group=group)
    return parallel_state.get_data_parallel_rank(), loss, checkpoint_space(model, gradients=True), reduced_tracker()


@pytest.mark.parametrize("tp, ep, world", [(1, 2, 2), (2, 2, 4)], ids=["ep2", "tp2xep2_sp"])
def test_hybrid_moe_matches_single_process(tp, ep, world):
    dp = world // tp
    kinds, losses, grads, missing, tracker = run_distributed(1, _reference, dp)[0]
    assert kinds == ["NoneType", "IdentityOp", "MoELayer", "MLP"]
    assert not missing, f"parameters without a gradient: {missing}"
    assert set(tracker) == {"load_balancing_loss", "z_loss"}
    assert tracker["z_loss"][2] > 0 and tracker["z_loss"][[0, 1, 3]].abs().sum() == 0  # only layer 3 routes
    for dp_rank, loss, parallel_grads, parallel_tracker in run_distributed(world, _parallel, tp, ep, dp):
        assert abs(loss - losses[dp_rank]) <= 1e-5 * abs(losses[dp_rank])
        assert parallel_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert relative_error(parallel_grads[name], grad) <= 1e-5, name
        for name, values in tracker.items():
            assert relative_error(parallel_tracker[name], values) <= 1e-5, name


def _pipeline(pp, pattern):
    fresh_moe_state()
    return run_pipeline(pp, pattern, config_overrides=MOE_FIELDS)


def test_moe_layers_on_both_pipeline_stages_match_one_stage():
    """'|' puts an 'E' layer on each of two stages; 1F1B over four micro-batches (the aux losses' gradient
    scaled by the schedule on both) equals the single-stage model: loss, weights and every gradient."""
    expected = run_distributed(1, _pipeline, 1, "M*E-E")[0]
    first, last = run_distributed(2, _pipeline, 2, "M*E|-E")
    assert (first["layers"], last["layers"]) == ("M*E", "-E")
    assert first["loss"] is None and relative_error(last["loss"], expected["loss"]) <= 1e-6
    for result in (first, last):
        assert_close_dicts(result["weights"], expected["weights"], 0.0, "pp=2 weights")
        assert_close_dicts(result["grads"], expected["grads"], 1e-5, "pp=2 grads")


def _save(directory, pp, pattern):
    model = build_model(pp=pp, pattern=pattern, seed=1, config_overrides=MOE_FIELDS)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, directory)
    return checkpoint_space(model)


def _load(directory, pp, ep, pattern):
    model = build_model(pp=pp, ep=ep, pattern=pattern, seed=2, config_overrides=MOE_FIELDS)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(loaded["model"])
    return checkpoint_space(model)


def test_a_checkpoint_with_moe_layers_saved_at_pp2_loads_at_one_rank_and_at_ep2(tmp_path):
    directory = str(tmp_path)
    saved = run_distributed(2, _save, directory, 2, "M*E|-E")[0]
    assert any(".mlp.experts." in key for key in saved)
    at_one_rank = run_distributed(1, _load, directory, 1, 1, "M*E-E")[0]
    assert any(
        not at_one_rank[key].equal(value) for key, value in run_distributed(1, _load_nothing, "M*E-E")[0].items()
    )  # a fresh model differs: the load did work
    assert_close_dicts(at_one_rank, saved, 0.0, "pp=1 load")
    for rank, at_ep2 in enumerate(run_distributed(2, _load, directory, 1, 2, "M*E-E")):
        assert_close_dicts(at_ep2, saved, 0.0, f"ep=2 load, rank {rank}")


def _load_nothing(pattern):
    return checkpoint_space(build_model(pattern=pattern, seed=2, config_overrides=MOE_FIELDS))


def _keys_and_flags():
    model = _model(1, 2)
    layer = model.decoder.layers[2]
    expert_flags = {name: getattr(p, "allreduce", True) for name, p in layer.mlp.experts.named_parameters()}
    shapes = {
        key: tuple(tensor.shape)
        for key, tensor in checkpoint_space(model).items()
        if key.startswith("decoder.layers.2.")
    }
    return isinstance(layer.mlp, MoELayer), expert_flags, shapes


def test_moe_layer_checkpoint_keys_and_expert_parameters():
    is_moe, expert_flags, shapes = run_distributed(2, _keys_and_flags)[0]
    assert is_moe and expert_flags and not any(expert_flags.values())  # experts skip the dense DP all-reduce
    hidden, experts = 64, 4
    assert shapes == {
        "decoder.layers.2.pre_mlp_layernorm.weight": (hidden,),
        "decoder.layers.2.mlp.router.weight": (experts, hidden),
        "decoder.layers.2.mlp.experts.experts.linear_fc1.weight": (experts, 32, hidden),
        "decoder.layers.2.mlp.experts.experts.linear_fc2.weight": (experts, hidden, 32),
        "decoder.layers.2.mlp.shared_experts.linear_fc1.weight": (32, hidden),
        "decoder.layers.2.mlp.shared_experts.linear_fc2.weight": (hidden, 32),
    }, shapes


def test_moe_layers_need_num_moe_experts():
    config = build_config(num_layers=2)
    with pytest.raises(
        ValueError,
        match=r"layer_type_list 'ME' has MoE layers \('E'\) but config.num_moe_experts "
        r"is None; set num_moe_experts \(--num-experts\)",
    ):
        HybridStack(config, hybrid_stack_spec.submodules, layer_type_list=["M", "E"])
