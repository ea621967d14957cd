"""DP=2 and DP=4 reach the single-process weights (fp32), with and without overlap and the distributed optimizer.

Every rank also trains the single-process reference itself (same seed, whole global batch), so one multi-rank run
checks a whole set of layouts without extra process start-ups.
"""

import pytest

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.distributed.ddp_test_helpers import (
    TinyLM,
    max_relative_error,
    train_data_parallel,
    train_reference,
    weights,
    wrap,
)
from tests.unit_tests.test_utilities import Utils, run_distributed

STEPS, GLOBAL_BATCH, MICROBATCHES = 3, 8, 2

LAYOUTS = {
    "plain": dict(),
    "overlap": dict(overlap_grad_reduce=True, bucket_size=300),
    "distopt": dict(use_distributed_optimizer=True),
    "distopt+overlap": dict(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=300
    ),
    "average_in_collective": dict(average_in_collective=True, overlap_grad_reduce=True, bucket_size=300),
}


def _opt_config(distributed: bool, optimizer: str = "adam") -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=optimizer, lr=1e-2, weight_decay=0.1, clip_grad=0.5, use_distributed_optimizer=distributed
    )


def _all_layouts_match_single_process():
    Utils.initialize_model_parallel()
    reference = TinyLM()
    reference_norms = train_reference(reference, _opt_config(False), STEPS, GLOBAL_BATCH, MICROBATCHES)
    expected = weights(reference)
    results = {}
    for name, layout in LAYOUTS.items():
        ddp_config = DistributedDataParallelConfig(**layout)
        model = wrap(TinyLM(), ddp_config)
        optimizer = get_megatron_optimizer(_opt_config(ddp_config.use_distributed_optimizer), [model])
        buckets = sum(len(buffer.buckets) for buffer in model.buffers)
        norms = train_data_parallel(model, optimizer, STEPS, GLOBAL_BATCH, MICROBATCHES)
        norm_error = max(abs(a - b) / b for a, b in zip(norms, reference_norms))
        # state_dict() first completes any all-gather still pending from the last step (overlap_param_gather).
        final = {key: value.float() for key, value in model.state_dict().items()}
        results[name] = (max_relative_error(final, expected), norm_error, type(optimizer).__name__, buckets)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_matches_single_process(world_size):
    for rank, results in enumerate(run_distributed(world_size, _all_layouts_match_single_process)):
        for layout, (weight_error, norm_error, optimizer, buckets) in results.items():
            assert weight_error < 1e-5, f"DP={world_size} {layout} rank {rank}: weights off by {weight_error:.2e}"
            assert norm_error < 1e-5, f"DP={world_size} {layout} rank {rank}: grad norm off by {norm_error:.2e}"
            distributed = "distopt" in layout
            assert optimizer == ("DistributedOptimizer" if distributed else "FP32Optimizer")
            if "overlap" in layout:
                assert buckets > 1, f"{layout}: the small bucket size should give several buckets"


def _expert_parameters_get_a_chained_optimizer():
    # One layer marked as expert-parallel (allreduce=False) is reduced over the expert-DP group and stepped by a
    # second optimizer; together they must still match the single-process run.
    Utils.initialize_model_parallel()
    reference = TinyLM()
    reference_norms = train_reference(reference, _opt_config(False, "sgd"), STEPS, GLOBAL_BATCH, MICROBATCHES)
    results = []
    for distributed in (False, True):
        module = TinyLM()
        for param in module.layers[1].parameters():
            param.allreduce = False
        model = wrap(module, DistributedDataParallelConfig(use_distributed_optimizer=distributed))
        optimizer = get_megatron_optimizer(_opt_config(distributed, "sgd"), [model])
        norms = train_data_parallel(model, optimizer, STEPS, GLOBAL_BATCH, MICROBATCHES)
        results.append(
            (
                type(optimizer).__name__,
                [type(opt).__name__ for opt in optimizer.chained_optimizers],
                len(model.expert_parallel_buffers),
                max_relative_error(weights(module), weights(reference)),
                max(abs(a - b) / b for a, b in zip(norms, reference_norms)),
            )
        )
    return results


def test_expert_parameters_use_a_chained_optimizer_and_still_match():
    for rank_results in run_distributed(2, _expert_parameters_get_a_chained_optimizer):
        (chained, parts, expert_buffers, error, norm_error), distributed = rank_results
        assert (chained, parts, expert_buffers) == ("ChainedOptimizer", ["FP32Optimizer", "FP32Optimizer"], 1)
        assert distributed[1] == ["DistributedOptimizer", "DistributedOptimizer"]
        assert error < 1e-5 and norm_error < 1e-5
        assert distributed[3] < 1e-5 and distributed[4] < 1e-5
