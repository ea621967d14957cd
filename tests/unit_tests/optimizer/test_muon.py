"""Muon: Newton-Schulz orthogonalisation, the q/k/v split, tensor-parallel modes and data parallelism (muon and
the layer-wise dist_muon) against one process, checkpoint resume, and bad input."""

import copy

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.muon import TensorParallelMuon
from megatron.core.transformer.module import Float16Module
from megatron.core.optimizer.muon_utils import (
    get_muon_scale_factor,
    join_qkv_rows,
    newton_schulz,
    newton_schulz_tp,
    split_qkv_rows,
)
from tests.unit_tests.models import gpt_test_helpers as gpt
from tests.unit_tests.test_utilities import Utils, run_distributed

STEPS, GLOBAL_BATCH = 3, 4


@pytest.mark.parametrize(
    "coefficients, steps, band",
    [("quintic", 5, (0.9, 1.1)), ("simple", 5, (0.6, 1.2)), ("polar_express", 8, (0.95, 1.05)), ("aol", 4, (0.9, 1.1))],
)
@pytest.mark.parametrize("shape", [(64, 32), (24, 96)])
def test_newton_schulz_singular_values_lie_in_the_published_band(coefficients, steps, band, shape):
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(*shape, generator=generator) * 3.0
    for low_precision in (False, True):
        result = newton_schulz(matrix, steps, coefficients, low_precision=low_precision)
        singular = torch.linalg.svdvals(result)
        assert result.shape == matrix.shape and result.dtype == torch.float32
        assert band[0] <= singular.min() and singular.max() <= band[1], (coefficients, low_precision, singular)
        # The input's singular vectors (U S' V^T with S' in the band): U^T result V is diagonal.
        u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
        core = u.mT @ result @ vh.mT
        off_diagonal = core - torch.diag_embed(torch.diagonal(core))
        assert off_diagonal.norm() < 0.05 * core.norm(), (coefficients, low_precision)


def test_scale_factors_and_qkv_split_round_trip():
    assert get_muon_scale_factor(64, 16, "spectral") == 8.0
    assert get_muon_scale_factor(64, 16, "unit_rms_norm") == 2.0
    assert get_muon_scale_factor(16, 64, "shape_scaling") == 1.0
    assert get_muon_scale_factor(64, 16, "shape_scaling") == 2.0
    # Two query groups of [2 q heads, 1 k head, 1 v head] with 3 channels per head, hidden 5.
    shapes = [6, 3, 3]
    fused = torch.arange(2 * 12 * 5, dtype=torch.float32).view(24, 5)
    q, k, v = split_qkv_rows(fused, shapes)
    assert torch.equal(q, torch.cat([fused[0:6], fused[12:18]]))
    assert torch.equal(k, torch.cat([fused[6:9], fused[18:21]]))
    assert torch.equal(v, torch.cat([fused[9:12], fused[21:24]]))
    assert torch.equal(join_qkv_rows([q, k, v], shapes), fused)


def _tensor_parallel_modes():
    Utils.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    full = torch.randn(48, 32, generator=torch.Generator().manual_seed(3))
    errors = {}
    for dim in (0, 1):
        expected = newton_schulz(full, 5).chunk(2, dim=dim)[rank]
        shard = full.chunk(2, dim=dim)[rank]
        for mode in ("duplicated", "distributed"):
            result = newton_schulz_tp(shard, 5, "quintic", group, partition_dim=dim, mode=mode)
            errors[mode, dim] = (result - expected).norm().item() / expected.norm().item()
        # Blockwise: the shard is orthogonalised on its own (Muon's optimizer passes no partition_dim).
        blockwise = newton_schulz_tp(shard, 5, "quintic", group, partition_dim=None)
        errors["blockwise", dim] = (blockwise - newton_schulz(shard, 5)).abs().max().item()
        errors["blockwise differs", dim] = (blockwise - expected).norm().item() / expected.norm().item()
    return errors


def test_tensor_parallel_newton_schulz_modes_match_the_whole_matrix():
    for errors in run_distributed(2, _tensor_parallel_modes):
        for dim in (0, 1):
            assert errors["duplicated", dim] <= 1e-5 and errors["distributed", dim] <= 1e-5, errors
            assert errors["blockwise", dim] == 0.0 and errors["blockwise differs", dim] > 1e-2, errors


def _opt_config(**overrides) -> OptimizerConfig:
    # fp32 Newton-Schulz ('high'), so layouts compare to fp32 rounding.
    base = dict(lr=1e-2, weight_decay=0.1, clip_grad=1.0, optimizer="muon", muon_fp32_matmul_prec="high")
    return OptimizerConfig(**{**base, **overrides})


def _batch(step: int):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, gpt.VOCAB, (GLOBAL_BATCH, gpt.SEQ), generator=generator)
    labels = torch.randint(0, gpt.VOCAB, (GLOBAL_BATCH, gpt.SEQ), generator=generator)
    return tokens, torch.arange(gpt.SEQ).expand(GLOBAL_BATCH, gpt.SEQ), labels


def _train(model, optimizer, ddp=None, steps=STEPS, first_step=0, same_batch=False):
    dp_rank = parallel_state.get_data_parallel_rank() if ddp is not None else 0
    dp_size = parallel_state.get_data_parallel_world_size() if ddp is not None else 1
    losses = []
    for step in range(first_step, first_step + steps):
        if ddp is not None:
            ddp.zero_grad_buffer()
        optimizer.zero_grad()
        batch = _batch(first_step if same_batch else step)
        tokens, positions, labels = (t.chunk(dp_size)[dp_rank] for t in batch)
        loss = (ddp or model)(tokens, positions, None, labels=labels).mean()
        loss.backward()
        finalize_model_grads([ddp or model])
        optimizer.step()
        losses.append(loss.item())
    return losses


def _reference(**overrides):
    model = gpt.build_model(1, False, "llama")
    losses = _train(model, get_megatron_optimizer(_opt_config(**overrides), [model]))
    return losses, gpt.full_weights(model)


def _worst(actual: dict, expected: dict) -> float:
    return max(gpt.relative_error(actual[name], expected[name]) for name in expected)


def _tensor_parallel_training():
    results = {}
    for nesterov, scale_mode in ((False, "spectral"), (True, "unit_rms_norm")):
        _, expected = _reference(muon_nesterov=nesterov, muon_scale_mode=scale_mode)
        for mode in ("duplicated", "distributed"):
            model = gpt.build_model(2, True, "llama")
            config = _opt_config(muon_tp_mode=mode, muon_nesterov=nesterov, muon_scale_mode=scale_mode)
            _train(model, get_megatron_optimizer(config, [model]))
            results[mode, nesterov] = _worst(gpt.full_weights(model), expected)
    model = gpt.build_model(2, True, "llama")
    blockwise = get_megatron_optimizer(_opt_config(muon_tp_mode="blockwise"), [model])
    losses = _train(model, blockwise, steps=6, same_batch=True)
    results["blockwise first/last loss"] = (losses[0], losses[-1])
    return results


def test_tensor_parallel_muon_matches_one_process():
    for rank, results in enumerate(run_distributed(2, _tensor_parallel_training)):
        first, last = results.pop("blockwise first/last loss")
        assert last < first, f"rank {rank}: blockwise TP2 loss did not decrease ({first} -> {last})"
        for key, error in results.items():
            assert error <= 1e-5, f"rank {rank} TP2 {key}: weights off by {error:.2e}"


def _data_parallel_training():
    reference_losses, expected = _reference()
    Utils.initialize_model_parallel()
    results = {}
    for optimizer_name in ("muon", "dist_muon"):
        model = gpt.build_model(1, False, "llama")
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        optimizer = get_megatron_optimizer(_opt_config(optimizer=optimizer_name), [ddp])
        losses = _train(model, optimizer, ddp)
        held = optimizer.state_bytes()
        results[optimizer_name] = (_worst(gpt.full_weights(model), expected), type(optimizer).__name__, held, losses)
    return results, reference_losses


def test_data_parallel_muon_and_dist_muon_match_one_process():
    for rank, (results, reference_losses) in enumerate(run_distributed(2, _data_parallel_training)):
        for name, (error, kind, _, _) in results.items():
            assert error <= 1e-5, f"rank {rank} DP2 {name}: weights off by {error:.2e}"
        assert results["muon"][1] == "ChainedOptimizer"
        assert results["dist_muon"][1] == "LayerWiseDistributedOptimizer"
        # Layer-wise sharding: each rank holds the state of about half of the parameters.
        assert results["dist_muon"][2] < 0.7 * results["muon"][2]
        assert reference_losses[-1] < reference_losses[0]


def _checkpoint_resume():
    results = {}
    for optimizer_name in ("muon", "dist_muon"):

        def build():
            model = gpt.build_model(1, False, "llama")
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
            optimizer = get_megatron_optimizer(_opt_config(optimizer=optimizer_name, muon_nesterov=True), [ddp])
            return model, ddp, optimizer

        model, ddp, optimizer = build()
        _train(model, optimizer, ddp, steps=2)
        saved_model, saved_optimizer = copy.deepcopy(ddp.state_dict()), copy.deepcopy(optimizer.state_dict())
        straight = _train(model, optimizer, ddp, steps=2, first_step=2)
        model_b, ddp_b, optimizer_b = build()
        ddp_b.load_state_dict(saved_model)
        optimizer_b.load_state_dict(saved_optimizer)
        resumed = _train(model_b, optimizer_b, ddp_b, steps=2, first_step=2)
        results[optimizer_name] = (straight, resumed, _worst(gpt.full_weights(model_b), gpt.full_weights(model)))
    return results


def test_checkpoint_resume_gives_identical_losses():
    for results in run_distributed(2, _checkpoint_resume):
        for name, (straight, resumed, weight_error) in results.items():
            assert straight == resumed and weight_error == 0.0, (name, straight, resumed, weight_error)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(muon_num_ns_steps=3),
            r"muon_num_ns_steps=3 does not fit muon_coefficient_type='quintic': it must be a "
            r"multiple of 5",
        ),
        (dict(muon_coefficient_type="polar_express"), r"muon_num_ns_steps=5 does not fit .*at least 8"),
        (dict(muon_coefficient_type="cubic"), r"muon_coefficient_type='cubic' is not one of"),
        (dict(muon_scalar_optimizer="sgd"), r"muon_scalar_optimizer='sgd' is not one of \('adam', 'lion'\)"),
        (dict(fp16=True), r"optimizer='muon' does not support fp16"),
        (dict(use_distributed_optimizer=True), r"use optimizer='dist_muon'"),
        (dict(optimizer="adam", use_layer_wise_distributed_optimizer=True), r"needs optimizer='muon' or 'dist_muon'"),
    ],
)
def test_muon_config_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        _opt_config(**overrides)


def _unsplittable_qkv():
    # kv_channels that do not tile the fused QKV rows: the split cannot divide linear_qkv.
    model = gpt.build_model(1, False, "llama")
    model.config.kv_channels = 7
    try:
        get_megatron_optimizer(_opt_config(), [model])
    except ValueError as error:
        return str(error)
    return None


def test_muon_refuses_a_qkv_weight_it_cannot_split():
    message = run_distributed(1, _unsplittable_qkv)[0]
    assert (
        message is not None
        and "muon_split_qkv=True cannot split decoder.layers.0.self_attention.linear_qkv" in (message)
        and "set muon_split_qkv=False" in message
    )


def test_tensor_parallel_muon_step_follows_the_published_update():
    # One matrix, no decay: momentum EMA, Nesterov direction, orthogonalised and spectrally scaled.
    param = torch.nn.Parameter(torch.zeros(8, 4))
    optimizer = TensorParallelMuon(
        [param], lr=0.5, momentum_beta=0.9, use_nesterov=True, weight_decay=0.0, fp32_matmul_prec="high"
    )
    grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    param.grad = grad.clone()
    optimizer.step()
    direction = grad.lerp(0.1 * grad, 0.9)
    expected = -0.5 * newton_schulz(direction, 5) * 8**0.5
    assert torch.allclose(param.detach(), expected, atol=1e-6)


def _tensor_and_data_parallel_dist_muon():
    _, expected = _reference(muon_nesterov=True)
    results = {}
    for mode in ("duplicated", "distributed"):
        model = gpt.build_model(2, True, "llama")
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        config = _opt_config(optimizer="dist_muon", muon_tp_mode=mode, muon_nesterov=True)
        _train(model, get_megatron_optimizer(config, [ddp]), ddp)
        results[mode] = _worst(gpt.full_weights(model), expected)
    return results


def test_dist_muon_at_tp2_dp2_matches_one_process():
    for rank, results in enumerate(run_distributed(4, _tensor_and_data_parallel_dist_muon)):
        for mode, error in results.items():
            assert error <= 1e-5, f"rank {rank} TP2 x DP2 dist_muon {mode}: weights off by {error:.2e}"


def _bf16_round_trip():
    results = {}
    for optimizer_name in ("muon", "dist_muon"):

        def build():
            model = gpt.build_model(1, False, "llama", config_overrides={"bf16": True, "params_dtype": torch.bfloat16})
            model = Float16Module(model.config, model)
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
            config = _opt_config(optimizer=optimizer_name, bf16=True, muon_fp32_matmul_prec="medium")
            return model, ddp, get_megatron_optimizer(config, [ddp])

        model, ddp, optimizer = build()
        first = _train(model, optimizer, ddp, steps=2)
        saved_model, saved_optimizer = copy.deepcopy(ddp.state_dict()), copy.deepcopy(optimizer.state_dict())
        straight = _train(model, optimizer, ddp, steps=2, first_step=2)
        model_b, ddp_b, optimizer_b = build()
        ddp_b.load_state_dict(saved_model)
        optimizer_b.load_state_dict(saved_optimizer)
        resumed = _train(model_b, optimizer_b, ddp_b, steps=2, first_step=2)
        results[optimizer_name] = (first + straight, resumed)
    return results


def test_bf16_muon_trains_and_resumes_exactly():
    for results in run_distributed(2, _bf16_round_trip):
        for name, (losses, resumed) in results.items():
            assert losses[2:] == resumed, (name, losses, resumed)
        # Both shard the same update: the layer-wise optimizer steps each parameter once, on its owner.
        assert results["muon"][0] == results["dist_muon"][0]


def _expert_parallel_muon():
    from tests.unit_tests.distributed.test_expert_data_parallel import ToyMoE, _global_weights
    from tests.unit_tests.distributed.test_expert_data_parallel import _train as train_moe

    Utils.initialize_model_parallel(expert_model_parallel_size=2)
    config = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.3, muon_fp32_matmul_prec="high")
    reference = ToyMoE()
    train_moe(reference, get_megatron_optimizer(OptimizerConfig(optimizer="muon", **config), [reference]))
    expected = _global_weights(reference)
    ep_group = parallel_state.get_expert_model_parallel_group()
    results = {}
    for name in ("muon", "dist_muon"):
        module = ToyMoE(2, dist.get_rank(ep_group), ep_group)
        ddp = DistributedDataParallel(gpt.build_config(1, False, {}), DistributedDataParallelConfig(), module)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer=name, **config), [ddp])
        train_moe(module, optimizer, ddp, 0, 1)
        weights = _global_weights(module)
        results[name] = max(gpt.relative_error(weights[k], expected[k]) for k in weights)
    return results


def test_expert_parallel_muon_matches_one_process():
    # EP=2 on 2 ranks: each rank holds half of the experts (stepped by an expert Muon on the expert groups).
    for rank, results in enumerate(run_distributed(2, _expert_parallel_muon)):
        for name, error in results.items():
            assert error <= 1e-5, f"rank {rank} EP2 {name}: weights off by {error:.2e}"


def _pipeline_forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    loss = model(tokens, labels)
    return loss, lambda output: (output, {"loss": output.detach()})


def _pipeline_and_data_parallel_muon():
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from tests.unit_tests.distributed.ddp_test_helpers import SEQ, TinyLM, make_batch, model_config, train_reference

    muon = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.5, muon_fp32_matmul_prec="high", muon_nesterov=True)
    Utils.initialize_model_parallel()
    reference = TinyLM()
    train_reference(reference, OptimizerConfig(optimizer="muon", **muon), STEPS, 8, 2)
    expected = {name: p.detach() for name, p in reference.named_parameters()}
    Utils.initialize_model_parallel(pipeline_model_parallel_size=2)
    pp_rank, dp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    results = {}
    for name in ("muon", "dist_muon"):
        config = model_config(num_layers=4, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
        stage = TinyLM(
            first_layer=2 * pp_rank, last_layer=2 * pp_rank + 2, pre_process=pp_rank == 0, post_process=pp_rank == 1
        )
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), stage)
        config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer=name, **muon), [ddp])
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            tokens, labels = (t.chunk(2)[dp_rank] for t in make_batch(8, seed=step))
            get_forward_backward_func()(
                forward_step_func=_pipeline_forward_step,
                data_iterator=zip(tokens.chunk(2), labels.chunk(2)),
                model=[ddp],
                num_microbatches=2,
                seq_length=SEQ,
                micro_batch_size=2,
            )
            optimizer.step()
        errors = []
        for local_name, param in stage.named_parameters():
            if local_name.startswith("layers."):
                index, rest = local_name[len("layers.") :].split(".", 1)
                local_name = f"layers.{int(index) + 2 * pp_rank}.{rest}"
            errors.append(gpt.relative_error(param.detach(), expected[local_name]))
        results[name] = max(errors)
    return results


def test_pipeline_and_data_parallel_muon_matches_one_process():
    for rank, results in enumerate(run_distributed(4, _pipeline_and_data_parallel_muon)):
        for name, error in results.items():
            assert error <= 1e-5, f"rank {rank} PP2 x DP2 {name}: weights off by {error:.2e}"
