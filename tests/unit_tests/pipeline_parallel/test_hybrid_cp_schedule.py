"""pipeline_parallel.hybrid_cp_schedule: Megatron's names import; the sizing arithmetic works (values from
Megatron-Core 0.19 itself); whatever needs hybrid context parallelism is one clear error."""

import inspect

import pytest

from megatron.core.pipeline_parallel import hybrid_cp_schedule
from megatron.core.pipeline_parallel.hybrid_cp_schedule import (
    BalancedCPScheduler,
    hybrid_context_parallel_forward_backward,
)


class _EightRanks:
    def size(self):
        return 8


def test_sizing_matches_megatron():
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=1024, dp_cp_group=_EightRanks())
    assert scheduler.total_hdp_gpus == 8
    lengths = (1, 512, 1024, 1025, 2048, 3000, 5000, 8192)
    assert [scheduler.gpus_needed(n) for n in lengths] == [1, 1, 1, 2, 2, 4, 8, 8]
    assert scheduler.get_total_workload(512) == 262144.0  # one rank
    assert scheduler.get_total_workload(3000) == 2250000.0  # 3000^2 over 4 ranks
    assert scheduler.get_total_workload(3000, 2) == 4500000.0


def test_forward_backward_has_megatrons_signature():
    assert list(inspect.signature(hybrid_context_parallel_forward_backward).parameters) == [
        "forward_step_func",
        "data_iterator",
        "model",
        "num_microbatches",
        "input_tensor",
        "output_tensor_grad",
        "forward_data_store",
        "config",
        "collect_non_loss_data",
        "first_val_step",
        "forward_only",
        "no_sync_func",
        "total_num_tokens",
        "check_first_val_step",
        "model_type",
    ]


def test_what_needs_hybrid_context_parallelism_is_refused():
    scheduler = BalancedCPScheduler(1024, _EightRanks())
    calls = {
        "make_buckets_equal": lambda: scheduler.make_buckets_equal([(0, 10)], scheduler.get_total_workload),
        "next_hdp_group": lambda: scheduler.next_hdp_group([(0, 10)], scheduler.get_total_workload, 8),
        "get_groups_and_subsamples": lambda: scheduler.get_groups_and_subsamples([(0, 10)], None),
        "hybrid_context_parallel_forward_backward": lambda: hybrid_context_parallel_forward_backward(*[None] * 15),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"not supported yet: hybrid context parallelism \((\w+\.)?{name}\)"):
            call()
    assert "hybrid_context_parallel=False" in hybrid_cp_schedule._NOT_BUILT
