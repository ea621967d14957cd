"""Megatron's hybrid context-parallel schedule (``pipeline_parallel.hybrid_cp_schedule``): names only, mostly.

Hybrid context parallelism runs each packed sub-sample on its own number of data x context-parallel ranks (a long
sequence on 8, a short one on 1), regrouping ranks between groups of sub-samples. The model side of that (attention
on a per-sample sub-group of the CP ranks) is not built, and ``TransformerConfig`` refuses
``hybrid_context_parallel=True``. This module keeps Megatron's public names so code that imports them loads:

- :class:`BalancedCPScheduler` sizes sub-samples (:meth:`~BalancedCPScheduler.gpus_needed`,
  :meth:`~BalancedCPScheduler.get_total_workload`, pure arithmetic that works anywhere); forming the balanced
  groups, which only feeds the hybrid schedule, is refused;
- :func:`hybrid_context_parallel_forward_backward` is refused.

Each refusal is one ``ValueError`` that names the feature.
"""

from functools import lru_cache
from math import ceil, log2
from typing import Callable, List, Optional, Tuple

import torch

_NOT_BUILT = (
    "not supported yet: hybrid context parallelism ({what}); the model cannot run a sample on a sub-group of the "
    "context-parallel ranks. Use a fixed context_parallel_size (hybrid_context_parallel=False)"
)


def _refuse(what: str) -> ValueError:
    return ValueError(_NOT_BUILT.format(what=what))


class BalancedCPScheduler:
    """Balances packed sub-samples over the data x context-parallel ranks (``dp_cp_group``) by their attention cost,
    with at most ``max_seq_len_per_rank`` tokens of a sample on one rank."""

    def __init__(self, max_seq_len_per_rank: int, dp_cp_group: torch.distributed.ProcessGroup):
        self.max_seq_len_per_rank = max_seq_len_per_rank
        self.num_subsamples = 0
        self.num_subsamples_processed = 0
        self.free_resources = []
        self.total_hdp_gpus = dp_cp_group.size()

    @lru_cache(maxsize=128)
    def get_total_workload(self, seq_length: int, cp_size: Optional[int] = None):
        """Relative cost of a sub-sample on each of its ranks: attention is quadratic in ``seq_length`` and split
        over ``cp_size`` ranks (default :meth:`gpus_needed`). A ranking, not a FLOP count."""
        if cp_size is None:
            cp_size = self.gpus_needed(seq_length)
        return (seq_length * seq_length) / cp_size

    @lru_cache(maxsize=128)
    def gpus_needed(self, seq_len: int) -> int:
        """Ranks a sub-sample of ``seq_len`` tokens needs: enough for ``max_seq_len_per_rank`` tokens each, rounded
        up to a power of two (the sizes of the hybrid CP groups)."""
        return max(1, 2 ** ceil(log2(seq_len / self.max_seq_len_per_rank)))

    def make_buckets_equal(
        self, sample_seqlens: List[Tuple[int, int]], compute_estimator: Callable[[int], float]
    ) -> list:
        """Split ``(sample_id, length)`` pairs into buckets of equal work, one per CP size: not built."""
        raise _refuse("BalancedCPScheduler.make_buckets_equal")

    def next_hdp_group(
        self,
        sample_seqlens: List[Tuple[int, int]],
        compute_estimator: Callable[[int], float],
        total_gpus: int,
        delta: float = 0.05,
        strategy: str = "dp",
        eps_bucket: float = 0.10,
    ) -> Tuple[List[List[int]], List[Tuple[int, int]], List[float], List[List[int]]]:
        """Form the next balanced group of sub-samples over ``total_gpus`` ranks: not built."""
        raise _refuse("BalancedCPScheduler.next_hdp_group")

    def get_groups_and_subsamples(self, sample_id_seqlens, config):
        """Form every group of a global batch: not built."""
        raise _refuse("BalancedCPScheduler.get_groups_and_subsamples")


def hybrid_context_parallel_forward_backward(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    input_tensor,
    output_tensor_grad,
    forward_data_store,
    config,
    collect_non_loss_data,
    first_val_step,
    forward_only,
    no_sync_func,
    total_num_tokens,
    check_first_val_step,
    model_type,
):
    """Megatron's forward/backward over the balanced groups of a global batch: refused (hybrid CP is not built)."""
    raise _refuse("hybrid_context_parallel_forward_backward")
