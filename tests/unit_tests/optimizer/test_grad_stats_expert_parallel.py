"""Gradient norm, clipping and zero count with expert parallelism equal the single-process values.

On 4 ranks at TP2 x EP2, with expert-TP 2 (expert-DP 1) and expert-TP 1 (expert-DP 2: every expert shard lives on
two ranks), each rank holds its slice of the same global gradients: a TP-split dense weight, a TP-replicated dense
norm, and per local expert an expert-TP-split weight and an expert-TP-replicated bias (``allreduce=False``). The
chained (dense + expert) optimizer must count every value exactly once: dense statistics over TP x PP with the
replicated norm on TP rank 0, expert statistics over expert-TP x EP x PP with the bias on expert-TP rank 0.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from tests.unit_tests.test_utilities import Utils, run_distributed

NUM_EXPERTS, MAX_NORM = 4, 0.5


def _global_grads():
    generator = torch.Generator().manual_seed(7)
    grads = {
        "dense_weight": torch.randn(8, 4, generator=generator),
        "dense_norm": torch.randn(4, generator=generator),
        **{f"expert{e}.weight": torch.randn(6, 4, generator=generator) for e in range(NUM_EXPERTS)},
        **{f"expert{e}.bias": torch.randn(4, generator=generator) for e in range(NUM_EXPERTS)},
    }
    for grad in grads.values():  # some exact zeros to count
        grad.view(-1)[::5] = 0.0
    return grads


def _local_module(grads, tp_rank, tp, ep_rank, ep, etp_rank, etp):
    """This rank's parameters (zeros) with their gradients: its slices of the global gradients."""
    module = torch.nn.Module()
    params = {}

    def add(name, grad, split, is_expert):
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        set_tensor_model_parallel_attributes(param, split, 0, 1)
        if is_expert:
            param.allreduce = False
        module.register_parameter(name.replace(".", "_"), param)
        params[name] = param

    add("dense_weight", grads["dense_weight"].chunk(tp)[tp_rank], True, False)
    add("dense_norm", grads["dense_norm"], False, False)
    per_rank = NUM_EXPERTS // ep
    for expert in range(ep_rank * per_rank, (ep_rank + 1) * per_rank):
        add(f"expert{expert}.weight", grads[f"expert{expert}.weight"].chunk(etp)[etp_rank], True, True)
        add(f"expert{expert}.bias", grads[f"expert{expert}.bias"], False, True)
    return module, params


def _stats_match_single_process(etp):
    Utils.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=etp
    )
    grads = _global_grads()
    module, params = _local_module(
        grads,
        parallel_state.get_tensor_model_parallel_rank(),
        2,
        parallel_state.get_expert_model_parallel_rank(),
        2,
        parallel_state.get_expert_tensor_parallel_rank(),
        etp,
    )
    config = OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=MAX_NORM, log_num_zeros_in_grad=True)
    optimizer = get_megatron_optimizer(config, [module], config_overrides={})
    everything = torch.cat([grad.reshape(-1) for grad in grads.values()])
    expected_norm = everything.norm().item()
    expected_zeros = float((everything == 0).sum())
    _, grad_norm, num_zeros = optimizer.step()
    # SGD with lr 1 from zero weights leaves minus the clipped gradient in every parameter.
    coefficient = MAX_NORM / (expected_norm + 1e-6)
    clip_error = max(
        (-param.detach() - _slice_of(grads, name, param) * coefficient).abs().max().item()
        for name, param in params.items()
    )
    return (
        grad_norm,
        expected_norm,
        num_zeros,
        expected_zeros,
        clip_error,
        dist.get_world_size(parallel_state.get_expert_data_parallel_group()),
    )


def _slice_of(grads, name, param):
    """The global gradient ``name`` cut like ``param`` (its shard along dim 0 on this rank)."""
    full = grads[name]
    if full.shape == param.shape:
        return full
    is_expert = name.startswith("expert")
    rank = (
        parallel_state.get_expert_tensor_parallel_rank()
        if is_expert
        else parallel_state.get_tensor_model_parallel_rank()
    )
    return full.chunk(full.shape[0] // param.shape[0])[rank]


@pytest.mark.parametrize("etp", [2, 1])
def test_grad_norm_zeros_and_clipping_with_ep_match_one_process(etp):
    for rank, (norm, expected_norm, zeros, expected_zeros, clip_error, expert_dp) in enumerate(
        run_distributed(4, _stats_match_single_process, etp)
    ):
        assert expert_dp == 4 // (2 * etp)
        assert norm == pytest.approx(expected_norm, rel=1e-6), f"rank {rank}: grad norm"
        assert zeros == expected_zeros, f"rank {rank}: zero count {zeros} vs {expected_zeros}"
        assert clip_error < 1e-6, f"rank {rank}: clipped gradients off by {clip_error:.2e}"


def _dense_stage_joins_the_expert_statistics():
    # PP2: stage 0 holds a dense and an expert parameter, stage 1 (say moe_layer_freq [1, 0]) only a dense one.
    Utils.initialize_model_parallel(pipeline_model_parallel_size=2)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    module = torch.nn.Module()
    module.dense = torch.nn.Parameter(torch.zeros(3))
    module.dense.grad = torch.full((3,), float(stage + 1))  # [1,1,1] and [2,2,2]
    if stage == 0:
        module.expert = torch.nn.Parameter(torch.zeros(2))
        module.expert.allreduce = False
        module.expert.grad = torch.tensor([0.0, 4.0])
    config = OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=1e9, log_num_zeros_in_grad=True)
    optimizer = get_megatron_optimizer(config, [module], config_overrides={})
    _, grad_norm, num_zeros = optimizer.step()
    return [type(opt).__name__ for opt in optimizer.chained_optimizers], grad_norm, num_zeros


def test_a_stage_without_experts_joins_the_expert_statistics():
    expected_norm = (3 * 1.0 + 3 * 4.0 + 16.0) ** 0.5
    stage0, stage1 = run_distributed(2, _dense_stage_joins_the_expert_statistics)
    assert stage0[0] == ["FP32Optimizer", "FP32Optimizer"]
    assert stage1[0] == ["FP32Optimizer", "NoLocalParamsOptimizer"]
    for _, grad_norm, num_zeros in (stage0, stage1):
        assert grad_norm == pytest.approx(expected_norm) and num_zeros == 1.0
