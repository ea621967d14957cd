"""Model-state bytes per rank follow the ZeRO-1 / Megatron distributed-optimizer accounting.

Per parameter, with d data-parallel ranks: bf16 params + fp32 grads + Adam = 6 + 12/d bytes with the distributed
optimizer (18 without); fp32 params = 8 + 8/d (16 without). Four ranks measure d = 4 with the global data-parallel
group and d = 2 and d = 1 with explicit process groups (pg_collection) in the same run.
"""

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module
from tests.unit_tests.distributed.ddp_test_helpers import model_config
from tests.unit_tests.test_utilities import Utils, run_distributed

WIDTH = 256  # three 256x256 layers: ~197k parameters, so bucket padding stays well under 1%


def _collection_with_dp_groups(rank_lists):
    """A ProcessGroupCollection whose data-parallel groups are ``rank_lists`` and model-parallel groups singletons."""
    rank = dist.get_rank()
    dp = [dist.new_group(ranks) for ranks in rank_lists]
    single = [dist.new_group([r]) for r in range(dist.get_world_size())]
    mine = next(group for group, ranks in zip(dp, rank_lists) if rank in ranks)
    return ProcessGroupCollection(
        tp=single[rank], mp=single[rank], expt_tp=single[rank], tp_ep_pp=single[rank], dp_cp=mine, expt_dp=mine
    )


def _measure(precision: str, distributed: bool, pg_collection):
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])
    num_params = sum(p.numel() for p in module.parameters())
    config = model_config(bf16=precision == "bf16")
    if precision == "bf16":
        module = Float16Module(config, module)
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
        module,
        pg_collection=pg_collection,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, bf16=precision == "bf16", use_distributed_optimizer=distributed),
        [model],
        pg_collection=pg_collection,
    )
    model.zero_grad_buffer()
    model(torch.randn(4, WIDTH)).float().pow(2).mean().backward()
    model.finish_grad_sync()
    optimizer.step()  # Adam creates its state on the first step

    if distributed:
        param_bytes = sum(b.param_data.numel() * b.param_data.element_size() for b in model.buffers)
    else:
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers)
    return num_params, param_bytes, grad_bytes, optimizer.state_bytes()


def _bytes_per_rank_for_each_dp_size():
    Utils.initialize_model_parallel()
    layouts = {
        4: None,
        2: _collection_with_dp_groups([[0, 1], [2, 3]]),
        1: _collection_with_dp_groups([[0], [1], [2], [3]]),
    }
    return {
        (d, precision, distributed): _measure(precision, distributed, groups)
        for d, groups in layouts.items()
        for precision in ("bf16", "fp32")
        for distributed in (True, False)
    }


EXPECTED_BYTES_PER_PARAM = {
    # (precision, distributed): bytes per parameter as a function of d
    ("bf16", True): lambda d: 6 + 12 / d,
    ("bf16", False): lambda d: 18,
    ("fp32", True): lambda d: 8 + 8 / d,
    ("fp32", False): lambda d: 16,
}
# The sharded part (fp32 main params of bf16 weights, Adam's two moments) is all the optimizer holds.
SHARDED_BYTES_PER_PARAM = {"bf16": 12, "fp32": 8}


def test_model_state_bytes_per_rank_follow_the_zero1_formula():
    results = run_distributed(4, _bytes_per_rank_for_each_dp_size)
    dp_peers = {4: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]], 1: [[0], [1], [2], [3]]}
    for (d, precision, distributed), _ in results[0].items():
        per_rank = [rank_results[(d, precision, distributed)] for rank_results in results]
        for num_params, param_bytes, grad_bytes, state_bytes in per_rank:
            expected = EXPECTED_BYTES_PER_PARAM[(precision, distributed)](d) * num_params
            measured = param_bytes + grad_bytes + state_bytes
            if distributed:
                # Buffers are padded so every rank owns an equal shard; padding stays under 1% here.
                assert abs(measured - expected) / expected < 0.01, (d, precision, measured, expected)
            else:
                assert measured == expected, (d, precision, measured, expected)
        if distributed:
            # Shards are disjoint and cover every parameter exactly once across each DP group.
            for peers in dp_peers[d]:
                total_state = sum(per_rank[r][3] for r in peers)
                assert total_state == SHARDED_BYTES_PER_PARAM[precision] * per_rank[0][0], (d, precision)
