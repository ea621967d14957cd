"""parallel_state additions for Megatron-Core 0.19: masked rank groups, create_group / update_pg_timeout, rank
setters, the global memory buffer, hierarchical and all-gather groups, NCCL option files."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator, generate_masked_orthogonal_rank_groups
from tests.unit_tests.test_utilities import run_distributed


def test_masked_orthogonal_groups_match_megatrons_documented_example():
    # tp=2, dp=3, pp=4 in order tp-dp-pp; the dp groups hold ranks tp_rank + 2*dp_rank + 6*pp_rank.
    groups = generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False])
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[7] == [19, 21, 23]
    assert len(groups) == 8
    tp_pp = generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [True, False, True])
    assert tp_pp[0] == [0, 1, 6, 7, 12, 13, 18, 19]


def test_masked_orthogonal_groups_reject_bad_sizes():
    with pytest.raises(ValueError, match=r"multiply to 6, not world size 8"):
        generate_masked_orthogonal_rank_groups(8, [2, 3], [True, False])
    with pytest.raises(ValueError, match=r"needs one entry per parallel size"):
        generate_masked_orthogonal_rank_groups(6, [2, 3], [True])


def test_rank_generator_mask_offset_and_gtp():
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp", rank_offset=4)
    assert generator.order == "tp-dp-cp-ep-pp"  # size-1 tokens appended
    assert generator.get_mask("tp-cp-dp-pp", "tp-dp") == [True, False, True, False]
    assert generator.get_ranks("dp") == [[4, 6], [5, 7]]
    assert generator.get_ranks("tp") == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"not supported yet: GTP weight rematerialisation \(gtp_remat=2\)"):
        RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp", gtp_remat=2)


def test_nccl_option_helpers():
    cfgs = {}
    ps.overwrite_nccl_comm_cfgs(cfgs, "tp", ("max_ctas", 8))
    ps.overwrite_nccl_comm_cfgs(cfgs, "tp", ("min_ctas", 2))
    assert cfgs == {"tp": {"max_ctas": 8, "min_ctas": 2}}
    assert ps.get_nccl_options("dp", cfgs) is None  # groups not listed keep NCCL's defaults
    with pytest.raises(ValueError, match=r"net_name \(ethernet\) for process group 'pp' is not supported"):
        ps.get_nccl_options("pp", {"pp": {"net_name": "ethernet"}})
    if not hasattr(dist, "ProcessGroupNCCL"):
        with pytest.raises(RuntimeError, match=r"this PyTorch build has no NCCL backend"):
            ps.get_nccl_options("tp", cfgs)


def _timeout_of(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _update_timeouts():
    ps.initialize_model_parallel(2, 2, distributed_timeout_minutes=5)
    tp, pp = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    before = (_timeout_of(tp), _timeout_of(pp))
    ps.update_pg_timeout(timedelta(minutes=9), pg=tp)
    only_tp = (_timeout_of(tp), _timeout_of(pp))
    ps.update_pg_timeout(timedelta(minutes=11))
    everywhere = (_timeout_of(tp), _timeout_of(pp), _timeout_of(ps.get_data_parallel_group()))
    # A group made directly with create_group joins the list that update_pg_timeout walks.
    extra = ps.create_group([0, 1, 2, 3], timeout=timedelta(minutes=2))
    ps.update_pg_timeout(timedelta(minutes=13))
    return before, only_tp, everywhere, _timeout_of(extra)


def test_update_pg_timeout_changes_the_groups_timeouts():
    for before, only_tp, everywhere, extra in run_distributed(4, _update_timeouts):
        assert before == (timedelta(minutes=5), timedelta(minutes=5))
        assert only_tp == (timedelta(minutes=9), timedelta(minutes=5))
        assert everywhere == (timedelta(minutes=11),) * 3
        assert extra == timedelta(minutes=13)


def _setters_and_extras():
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    real = (
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_data_parallel_rank(),
    )
    ps.set_expert_model_parallel_rank(5)
    ps.set_expert_model_parallel_world_size(8)
    ps.set_expert_tensor_parallel_rank(3)
    ps.set_expert_tensor_parallel_world_size(4)
    ps.set_data_parallel_rank(7)
    overridden = (
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_data_parallel_rank(),
    )
    all_ranks = ps.get_all_ranks()
    ps.set_data_parallel_rank(None)
    restored = ps.get_data_parallel_rank()
    buffer = ps.get_global_memory_buffer()
    a = buffer.get_tensor((2, 3), torch.float32, "scratch")
    b = buffer.get_tensor((6,), torch.float32, "scratch")
    c = buffer.get_tensor((2, 3), torch.float32, "other")
    same_memory = a.data_ptr() == b.data_ptr()
    separate_names = a.data_ptr() != c.data_ptr()
    amax = (
        ps.get_amax_reduction_group().size(),
        ps.get_amax_reduction_group(tp_only_amax_red=True).size(),
        ps.get_amax_reduction_group(with_context_parallel=True).size(),
    )
    intra = ps.get_intra_distributed_optimizer_instance_group().size()
    no_inter = ps.get_inter_distributed_optimizer_instance_group(check_initialized=False)
    try:
        ps.get_inter_distributed_optimizer_instance_group()
        inter_error = ""
    except RuntimeError as error:
        inter_error = str(error)
    ep_src = ps.get_expert_model_parallel_src_rank()
    ag = ps.create_all_gather_groups()
    ag_members = dist.get_process_group_ranks(ag)
    collection_ag = ps.get_process_group_collection().dp_cp_ag is ag
    ps.destroy_model_parallel()
    try:
        ps.get_global_memory_buffer()
        buffer_error = ""
    except RuntimeError as error:
        buffer_error = str(error)
    return {
        "real": real,
        "overridden": overridden,
        "all_ranks": all_ranks,
        "restored": restored,
        "buffer": (same_memory, separate_names, tuple(b.shape)),
        "amax": amax,
        "intra": intra,
        "inter": (no_inter, inter_error),
        "ep_src": ep_src,
        "ag": (ag_members, collection_ag),
        "buffer_error": buffer_error,
    }


def test_rank_setters_buffer_and_extra_groups():
    results = run_distributed(4, _setters_and_extras)
    for rank, result in enumerate(results):
        # Expert layout over (etp=2, ep=2): etp rank = rank % 2, ep rank = rank // 2; dense dp is the whole world.
        assert result["real"] == (rank // 2, 2, rank % 2, 2, rank)
        assert result["overridden"] == (5, 8, 3, 4, 7)
        assert result["all_ranks"] == "0_7_0_0_5"  # tp_dp_cp_pp_ep
        assert result["restored"] == rank
        assert result["buffer"] == (True, True, (6,))
        assert result["amax"] == (4, 1, 4)  # tp x dp; tp only; tp x cp x dp
        assert result["intra"] == 4
        assert result["inter"][0] is None
        assert "'inter_dist_opt' was not created" in result["inter"][1]
        assert result["ep_src"] == rank % 2
        assert result["ag"] == ([0, 1, 2, 3], True)
        assert "global memory buffer is not initialized" in result["buffer_error"]


def _hierarchical_groups():
    rank = dist.get_rank()
    groups, gloo_groups = ps.create_hierarchical_groups(
        rank, list(range(8)), [2, 4], create_gloo_process_groups=True, group_desc="CP"
    )
    return [dist.get_process_group_ranks(g) for g in groups], [g is not None for g in gloo_groups]


def test_create_hierarchical_groups():
    results = run_distributed(8, _hierarchical_groups)
    for rank, (members, has_gloo) in enumerate(results):
        # Level 0: pairs of consecutive ranks; level 1: ranks 2 apart within the same pair position.
        assert members[0] == [rank - rank % 2, rank - rank % 2 + 1]
        assert members[1] == [rank % 2 + 2 * i for i in range(4)]
        assert has_gloo == [True, True]


def test_create_hierarchical_groups_rejects_sizes_that_do_not_cover_the_ranks():
    with pytest.raises(ValueError, match=r"multiply to 6, not the 8 ranks given"):
        ps.create_hierarchical_groups(0, list(range(8)), [2, 3])


def _stage_predicates_default_to_the_physical_stage():
    ps.initialize_model_parallel(1, 2, 2)
    ps.set_virtual_pipeline_model_parallel_rank(1)  # the second model chunk of each stage
    return (
        ps.is_pipeline_first_stage(),  # Megatron's default ignore_virtual=True: the physical stage decides
        ps.is_pipeline_first_stage(ignore_virtual=False),
        ps.is_pipeline_last_stage(),
        ps.is_pipeline_last_stage(ignore_virtual=False),
        ps.is_rank_in_embedding_group(),
    )


def test_stage_predicates_ignore_virtual_stages_by_default():
    first, last = run_distributed(2, _stage_predicates_default_to_the_physical_stage)
    assert first == (True, False, False, False, True)  # chunk 1 of stage 0 is not the model's first chunk
    assert last == (False, False, True, True, True)  # chunk 1 of stage 1 is the model's last chunk
