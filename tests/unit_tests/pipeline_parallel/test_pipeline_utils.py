"""pipeline_parallel.utils: stage position and neighbours from an explicit pipeline group; viewless tensors."""

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import utils
from tests.unit_tests.test_utilities import Utils, run_distributed


def _positions():
    # TP=2 x PP=2 on 4 ranks: pipeline groups are {0, 2} and {1, 3}, so group ranks differ from global ranks.
    Utils.initialize_model_parallel(2, 2)
    group = parallel_state.get_pipeline_model_parallel_group()
    return (
        utils.is_pp_first_stage(group),
        utils.is_pp_last_stage(group),
        utils.get_pp_first_rank(group),
        utils.get_pp_last_rank(group),
        utils.get_pp_next_rank(group),
        utils.get_pp_prev_rank(group),
        parallel_state.get_pipeline_model_parallel_next_rank(),
        parallel_state.get_pipeline_model_parallel_prev_rank(),
    )


def test_stage_position_and_neighbours_are_global_ranks():
    results = run_distributed(4, _positions)
    for rank, (first, last, first_rank, last_rank, nxt, prev, mpu_next, mpu_prev) in enumerate(results):
        tp_rank, stage = rank % 2, rank // 2
        assert (first, last) == (stage == 0, stage == 1)
        assert (first_rank, last_rank) == (tp_rank, tp_rank + 2)
        assert nxt == prev == (rank + 2) % 4  # two stages: both neighbours are the other stage, wrapping around
        assert (nxt, prev) == (mpu_next, mpu_prev)


def test_virtual_stage_position():
    assert utils.is_vp_first_stage(0, None) and utils.is_vp_last_stage(0, None)  # no virtual stages
    assert utils.is_vp_first_stage(3, None) and utils.is_vp_last_stage(3, 1)
    assert utils.is_vp_first_stage(0, 3) and not utils.is_vp_last_stage(0, 3)
    assert not utils.is_vp_first_stage(2, 3) and utils.is_vp_last_stage(2, 3)


def test_make_viewless_keeps_storage_and_graph():
    x = torch.randn(4, 3, requires_grad=True)
    view = (x * 2).view(12)
    viewless = utils.make_viewless(view)
    assert view._base is not None and viewless._base is None
    assert viewless.data_ptr() == view.data_ptr() and viewless.shape == view.shape
    viewless.sum().backward()
    assert torch.equal(x.grad, torch.full((4, 3), 2.0))
    plain = torch.zeros(3)
    assert utils.make_viewless(plain) is plain and utils.make_viewless(None) is None
