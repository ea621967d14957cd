"""Megatron FSDP (FullyShardedDataParallel) against plain DDP: the same losses and every reduced gradient, for each
sharding strategy, at DP=2, DP=4 and TP=2 x DP=2 (fp32), and what each rank keeps between steps."""

import pytest

from tests.unit_tests.distributed import fsdp_test_helpers as fh
from tests.unit_tests.models import gpt_test_helpers as gpt
from tests.unit_tests.test_utilities import run_distributed

STEPS = 3


def _run(wrapped, optimizer, microbatches):
    losses, grads = [], []
    for step in range(STEPS):
        losses.append(
            fh.train_step(
                wrapped, optimizer, step, microbatches, after_grads=lambda w: grads.append(fh.reduced_gradients(w))
            )
        )
    return losses, grads, fh.full_weights(wrapped)


def _equivalence(tp, sp, variant, microbatches, layouts, overrides=None):
    reference = gpt.build_model(tp, sp, variant, config_overrides=overrides)
    ddp = fh.wrap(reference)
    expected = _run(ddp, fh.optimizer_for(ddp), microbatches)
    errors = {}
    for strategy, fields in layouts:
        model = gpt.build_model(tp, sp, variant, config_overrides=overrides)
        wrapped = fh.wrap(model, strategy, **fields)
        losses, grads, weights = _run(wrapped, fh.optimizer_for(wrapped), microbatches)
        loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, expected[0]))
        grad_error = max(
            gpt.relative_error(step_grads[name], expected[1][step][name])
            for step, step_grads in enumerate(grads)
            for name in step_grads
        )
        weight_error = max(gpt.relative_error(weights[n], expected[2][n]) for n in weights)
        errors[(strategy, tuple(sorted(fields)))] = (loss_error, grad_error, weight_error)
        assert set(grads[0]) == set(expected[1][0]), "every parameter has a gradient"
    return errors


ALL = [(s, {}) for s in fh.STRATEGIES]
OVERLAP = [
    ("optim_grads", {"overlap_grad_reduce": True}),
    ("optim_grads_params", {"overlap_grad_reduce": True, "overlap_param_gather": True}),
]


def _check(results, where):
    for rank, errors in enumerate(results):
        for (strategy, fields), (loss_error, grad_error, weight_error) in errors.items():
            what = f"{where} {strategy} {fields} rank {rank}"
            assert loss_error < 1e-6, f"{what}: losses off by {loss_error:.2e}"
            assert grad_error < 1e-5, f"{what}: gradients off by {grad_error:.2e}"
            # Adam (lr 1e-2) over several steps amplifies the 1e-7 rounding differences of the gradient sums (the
            # distributed optimizer's shard-wise steps do the same against DDP); the gradients agree to 1e-5.
            assert weight_error < 1e-3, f"{what}: weights off by {weight_error:.2e}"


def test_every_strategy_matches_ddp_at_dp2():
    _check(run_distributed(2, _equivalence, 1, False, "gpt2", 2, ALL + OVERLAP), "DP=2")


@pytest.mark.parametrize(
    "overrides",
    [
        # Recomputed layers run their forward again inside backward: the unit is gathered again for it.
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        # Gradients are summed, then divided by the global token count after the reduce-scatter.
        {"calculate_per_token_loss": True},
    ],
    ids=["full_recompute", "per_token_loss"],
)
def test_sharded_strategies_match_ddp_with_model_options(overrides):
    layouts = [("optim_grads", {}), ("optim_grads_params", {})]
    _check(run_distributed(2, _equivalence, 1, False, "gpt2", 2, layouts, overrides), str(overrides))


def test_every_strategy_matches_ddp_at_dp4():
    _check(run_distributed(4, _equivalence, 1, False, "gpt2", 1, ALL), "DP=4")


def test_every_strategy_matches_ddp_with_tp2_sequence_parallel_and_tied_embeddings():
    _check(run_distributed(4, _equivalence, 2, True, "llama", 2, ALL), "TP=2 x DP=2")


def _force_all_reduce(strategy):
    wrapped = fh.wrap(gpt.build_model(1, False, "gpt2"), strategy)
    try:
        wrapped.finish_grad_sync(force_all_reduce=True)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_force_all_reduce_is_refused_with_sharded_gradients(strategy):
    for message in run_distributed(2, _force_all_reduce, strategy):
        assert message is not None and "keeps only each rank's gradient shard; use 'optim'" in message


def _held_bytes(strategy, bf16):
    import torch
    import torch.distributed as dist

    from megatron.core.distributed.fsdp.memory import expected_held_bytes, held_bytes

    overrides = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    model = gpt.build_model(1, False, "gpt2", config_overrides=overrides)
    wrapped = fh.wrap(model, strategy, grad_reduce_in_fp32=bf16)
    optimizer = fh.optimizer_for(wrapped, bf16=bf16)
    for step in range(2):
        fh.train_step(wrapped, optimizer, step)
    held = held_bytes([wrapped], optimizer)
    expected = expected_held_bytes(wrapped, 12 if bf16 else 8)
    total_state = torch.tensor(float(held["optimizer"]))
    dist.all_reduce(total_state)
    num_params = sum(p.numel() for p in model.parameters())
    return held, expected, total_state.item(), num_params


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_bytes_held_per_rank_between_steps_match_the_formula(bf16):
    state_bytes = 12 if bf16 else 8
    for strategy in (None, *fh.STRATEGIES):
        results = run_distributed(2, _held_bytes, strategy, bf16)
        for rank, (held, expected, total_state, num_params) in enumerate(results):
            what = f"{strategy or 'DDP'} rank {rank}"
            assert held["params"] == expected["params"], what
            assert held["grads"] == expected["grads"], what
            if strategy in (None, "no_shard"):
                assert held["optimizer"] == expected["optimizer"] == num_params * state_bytes, what
            else:
                # Each rank steps the parameter elements of its shards: 1/DP of them up to bucket padding.
                assert total_state == num_params * state_bytes * 1.0, what
                assert abs(held["optimizer"] - expected["optimizer"]) <= 0.02 * expected["optimizer"], what


def _moe_model(ep):
    import torch
    import torch.nn.functional as F

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.test_utilities import Utils
    from tests.unit_tests.transformer.moe.moe_test_helpers import fresh_moe_state

    Utils.initialize_model_parallel(1, expert_model_parallel_size=ep)
    fresh_moe_state()
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.01,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type="alltoall",
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config, spec, vocab_size=gpt.VOCAB, max_sequence_length=gpt.SEQ, position_embedding_type="rope")


def _moe_equivalence(ep):
    reference = fh.wrap(_moe_model(ep))
    expected = _run(reference, fh.optimizer_for(reference), 2)
    errors = {}
    for strategy in fh.STRATEGIES:
        wrapped = fh.wrap(_moe_model(ep), strategy)
        losses, grads, weights = _run(wrapped, fh.optimizer_for(wrapped), 2)
        errors[(strategy, ())] = (
            max(abs(a - b) / abs(b) for a, b in zip(losses, expected[0])),
            max(gpt.relative_error(g[n], expected[1][s][n]) for s, g in enumerate(grads) for n in g),
            max(gpt.relative_error(weights[n], expected[2][n]) for n in weights),
        )
    return errors


def test_every_strategy_matches_ddp_with_moe_and_expert_parallelism():
    # EP=2 over 4 ranks: dense parameters are sharded over DP=4, expert parameters over expert-DP=2.
    _check(run_distributed(4, _moe_equivalence, 2), "MoE EP=2 x expert-DP=2")


def _bf16_equivalence():
    import torch

    overrides = {"bf16": True, "params_dtype": torch.bfloat16}

    def build(strategy):
        wrapped = fh.wrap(
            gpt.build_model(1, False, "gpt2", config_overrides=overrides), strategy, grad_reduce_in_fp32=True
        )
        return _run(wrapped, fh.optimizer_for(wrapped, bf16=True), 2)

    expected = build(None)
    errors = {}
    for strategy in fh.STRATEGIES:
        losses, grads, _ = build(strategy)
        errors[strategy] = (
            max(abs(a - b) / abs(b) for a, b in zip(losses, expected[0])),
            max(gpt.relative_error(g[n], expected[1][s][n]) for s, g in enumerate(grads) for n in g),
        )
    return errors


def test_bf16_with_fp32_main_params_matches_ddp():
    for rank, errors in enumerate(run_distributed(2, _bf16_equivalence)):
        for strategy, (loss_error, grad_error) in errors.items():
            # Within bf16's resolution (2^-7): after a step, fp32 rounding differences of the clipping norm (computed
            # per shard by the distributed optimizer) can flip the bf16 rounding of a few updated weights (which is
            # also why the weights themselves are not compared: Adam turns such flips in near-zero gradients into
            # whole learning-rate steps); the losses and gradients of the later steps see every update.
            assert loss_error < 1e-3, f"bf16 {strategy} rank {rank}: losses off by {loss_error:.2e}"
            assert grad_error < 1e-2, f"bf16 {strategy} rank {rank}: gradients off by {grad_error:.2e}"


def _dtype_options():
    import torch

    reference = fh.wrap(gpt.build_model(1, False, "gpt2"))
    expected = _run(reference, fh.optimizer_for(reference), 1)
    results = {}
    for name, fields in {
        "bf16 communication": dict(megatron_fsdp_grad_comm_dtype=torch.bfloat16),
        "bf16 main grads": dict(megatron_fsdp_main_grads_dtype=torch.bfloat16),
    }.items():
        wrapped = fh.wrap(gpt.build_model(1, False, "gpt2"), "optim_grads_params", **fields)
        losses, grads, _ = _run(wrapped, fh.optimizer_for(wrapped), 1)
        dtypes = {(b.grad_dtype, b.grad_shard.dtype, b.grad_comm_dtype) for b in wrapped.buffers}
        # The first step's gradients: the rounding of one reduction, before Adam amplifies it into the weights.
        results[name] = (
            abs(losses[0] - expected[0][0]) / abs(expected[0][0]),
            max(gpt.relative_error(grads[0][n], expected[1][0][n]) for n in grads[0]),
            dtypes,
        )
    return results


def test_gradient_dtype_options_reach_the_buffers_and_the_reduce_scatter():
    import torch

    fp32, bf16 = torch.float32, torch.bfloat16
    for results in run_distributed(2, _dtype_options):
        loss_error, grad_error, dtypes = results["bf16 communication"]
        assert dtypes == {(fp32, fp32, bf16)}
        # The reduce-scatter rounds each rank's gradients to bf16 (2^-8 relative) before summing them.
        assert 0 < grad_error < 1e-2 and loss_error < 1e-3
        loss_error, grad_error, dtypes = results["bf16 main grads"]
        assert dtypes == {(bf16, bf16, bf16)}
        assert 0 < grad_error < 2e-2 and loss_error < 1e-3


def _gathered_units_during_forward(overlap):
    from megatron.core.distributed.fsdp.sharded_buffer import ShardedParamAndGradBuffer

    fields = {"overlap_grad_reduce": True, "overlap_param_gather": True} if overlap else {}
    model = gpt.build_model(1, False, "gpt2", config_overrides={"num_layers": 4})
    wrapped = fh.wrap(model, "optim_grads_params", **fields)
    optimizer = fh.optimizer_for(wrapped)
    units = wrapped._unit_order
    seen = []

    def record(index):
        def hook(module, args):
            gathered = [
                i for i, unit in enumerate(units) if all(b.params_gathered for b in wrapped._unit_buffers[unit])
            ]
            seen.append((index, gathered))

        return hook

    for index, unit in enumerate(units):
        unit.register_forward_pre_hook(record(index))
    fh.train_step(wrapped, optimizer, 0)
    after_step = [b.params_gathered for b in wrapped.buffers if isinstance(b, ShardedParamAndGradBuffer)]
    return seen, after_step


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "prefetch"])
def test_parameters_are_gathered_one_layer_at_a_time(overlap):
    for seen, after_step in run_distributed(2, _gathered_units_during_forward, overlap):
        # While layer i runs forward only its own parameters are whole (with overlap, also the next layer's,
        # being prefetched); between steps every buffer holds only its shard.
        expected = [(i, [i, i + 1] if overlap and i + 1 < 4 else [i]) for i in range(4)]
        assert seen == expected
        assert not any(after_step)
