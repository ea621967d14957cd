"""parallel_state against Megatron's rank layout, checked with an independent reference.

The reference below is the rule itself, written the slow and obvious way: a rank's coordinates are the digits of a
mixed-radix number over the order string (first token fastest-varying), and the ranks that agree on every
coordinate outside a group's tokens form one group. Groups are listed by ascending first rank, members ascending,
which is the order Megatron's rank generator enumerates them in. Two anchors tie the reference to Megatron's
documentation: the 16-GPU example in ``initialize_model_parallel``'s docstring and the rank formula of the order
(``tp-cp-ep-dp-pp``: ``rank = tp_rank + cp_rank*tp + dp_rank*tp*cp + pp_rank*tp*cp*dp``).

The pure ``RankGenerator`` is checked over many layouts; real groups on real gloo ranks over a handful, each with
one ``run_distributed`` call that reports every group and accessor for the parent to compare.
"""

import functools
import os
import itertools
import re
from dataclasses import dataclass
from math import prod
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator
from tests.unit_tests.test_utilities import run_distributed

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
ALL_TOKENS = ("tp", "cp", "ep", "dp", "pp")

# Group kind -> the tokens its members differ in. Dense kinds use the dense layout, expert kinds the expert one.
DENSE_KINDS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "dp_cp": "dp-cp",
    "cp": "cp",
    "mp": "tp-pp",
    "tp_cp": "tp-cp",
    "tp_dp": "tp-dp",
    "tp_dp_cp": "tp-dp-cp",
}
EXPERT_KINDS = {"expt_tp": "tp", "ep": "ep", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp", "expt_dp": "dp"}


# ---- the independent reference ---------------------------------------------------------------------------------


def laid_out_tokens(order: str):
    """The order's tokens, then the ones it leaves out (those must have size 1, so where they go is immaterial)."""
    tokens = order.split("-")
    return tokens + [token for token in ALL_TOKENS if token not in tokens]


def coordinates(rank: int, order: str, sizes: dict) -> dict:
    coords = {}
    for token in laid_out_tokens(order):
        coords[token] = rank % sizes[token]
        rank //= sizes[token]
    return coords


def reference_groups(order: str, sizes: dict, varying: str):
    """Every group of ranks that differ only in the ``varying`` tokens (e.g. ``"tp-pp"``)."""
    varying_tokens = varying.split("-")
    by_fixed_coordinates = {}
    for rank in range(prod(sizes.values())):
        coords = coordinates(rank, order, sizes)
        fixed = tuple(coords[token] for token in ALL_TOKENS if token not in varying_tokens)
        by_fixed_coordinates.setdefault(fixed, []).append(rank)
    return sorted(by_fixed_coordinates.values())


def reference_group_of(rank: int, order: str, sizes: dict, varying: str):
    return next(group for group in reference_groups(order, sizes, varying) if rank in group)


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    order: str = DEFAULT_ORDER

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def dense_sizes(self) -> dict:
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    @property
    def expert_sizes(self) -> dict:
        return {"tp": self.expert_tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}

    def init_kwargs(self) -> dict:
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            order=self.order,
        )

    def __str__(self) -> str:
        etp = "" if self.etp is None else f",etp{self.etp}"
        return f"w{self.world_size}:tp{self.tp},pp{self.pp},cp{self.cp},ep{self.ep}{etp}:{self.order}"


# ---- anchors: the reference agrees with Megatron's documentation -----------------------------------------------


def test_reference_matches_megatrons_documented_16_gpu_example():
    # initialize_model_parallel's docstring: 16 GPUs, tp=2, pp=4 (so dp=2), default order.
    sizes = {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 4}
    expected = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "pp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    }
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order=DEFAULT_ORDER)
    for token, groups in expected.items():
        assert reference_groups(DEFAULT_ORDER, sizes, token) == groups
        assert generator.get_ranks(token) == groups


def test_reference_follows_the_default_order_rank_formula():
    tp, cp, dp, pp = 2, 2, 3, 2
    sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    for rank in range(tp * cp * dp * pp):
        c = coordinates(rank, DEFAULT_ORDER, sizes)
        assert rank == c["tp"] + c["cp"] * tp + c["dp"] * tp * cp + c["pp"] * tp * cp * dp


def test_tp_pp_dp_order_puts_pipeline_stages_next_to_tensor_ranks():
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp")
    assert generator.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert generator.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    default = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order=DEFAULT_ORDER)
    assert default.get_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert default.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_expert_generator_examples():
    # 8 ranks, ep=2 with expert-TP 1: expert-parallel pairs of neighbours, expert-DP over the rest.
    generator = RankGenerator(tp=1, ep=2, dp=4, pp=1, cp=1, order=DEFAULT_ORDER)
    assert generator.get_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert generator.get_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # ep=4 with expert-TP 2: EP strides over the expert-TP pairs.
    generator = RankGenerator(tp=2, ep=4, dp=1, pp=1, cp=1, order=DEFAULT_ORDER)
    assert generator.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert generator.get_ranks("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert generator.get_ranks("dp") == [[r] for r in range(8)]


# ---- the pure rank generator over many layouts -----------------------------------------------------------------

ORDERS_WITH_EVERY_TOKEN = [DEFAULT_ORDER, "tp-cp-ep-pp-dp", "pp-dp-ep-cp-tp"]
DENSE_TOKEN_STRINGS = sorted(set(DENSE_KINDS.values()))
EXPERT_TOKEN_STRINGS = sorted(set(EXPERT_KINDS.values()))


@pytest.mark.parametrize("order", ORDERS_WITH_EVERY_TOKEN + ["tp-pp-dp"])
def test_dense_rank_generator_matches_reference(order):
    cps = (1,) if order == "tp-pp-dp" else (1, 2)
    for tp, cp, dp, pp in itertools.product((1, 2, 4), cps, (1, 2, 3), (1, 2, 4)):
        sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
        generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        for token in DENSE_TOKEN_STRINGS:
            assert generator.get_ranks(token) == reference_groups(order, sizes, token), (sizes, token)


@pytest.mark.parametrize("order", ORDERS_WITH_EVERY_TOKEN + ["tp-pp-dp"])
def test_expert_rank_generator_matches_reference(order):
    # The expert layout has no cp axis; "tp-pp-dp" has no ep axis either, so ep must be 1 there.
    eps = (1,) if order == "tp-pp-dp" else (1, 2, 4)
    for etp, ep, edp, pp in itertools.product((1, 2), eps, (1, 2, 3), (1, 2)):
        sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
        generator = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
        for token in EXPERT_TOKEN_STRINGS:
            assert generator.get_ranks(token) == reference_groups(order, sizes, token), (sizes, token)


def test_get_ranks_ignores_the_order_tokens_are_named_in():
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order=DEFAULT_ORDER)
    assert generator.get_ranks("dp-tp") == generator.get_ranks("tp-dp")
    assert generator.get_ranks("tp-dp-cp") == generator.get_ranks("cp-dp-tp")


def test_get_ranks_rejects_unknown_token():
    generator = RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=1, order=DEFAULT_ORDER)
    with pytest.raises(ValueError, match=r"unknown parallelism token 'xp' in 'tp-xp'"):
        generator.get_ranks("tp-xp")


# ---- real groups on real ranks ---------------------------------------------------------------------------------

GROUP_GETTERS = {
    "tp": ps.get_tensor_model_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "dp": ps.get_data_parallel_group,
    "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "cp": ps.get_context_parallel_group,
    "mp": ps.get_model_parallel_group,
    "tp_cp": ps.get_tensor_and_context_parallel_group,
    "tp_dp": ps.get_tensor_and_data_parallel_group,
    "tp_dp_cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
    "expt_tp": ps.get_expert_tensor_parallel_group,
    "ep": ps.get_expert_model_parallel_group,
    "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
    "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group,
    "expt_dp": ps.get_expert_data_parallel_group,
    "embd": ps.get_embedding_group,
    "pos_embd": ps.get_position_embedding_group,
}
WORLD_SIZE_GETTERS = {
    "tp": ps.get_tensor_model_parallel_world_size,
    "pp": ps.get_pipeline_model_parallel_world_size,
    "dp": ps.get_data_parallel_world_size,
    "dp_cp": lambda: ps.get_data_parallel_world_size(with_context_parallel=True),
    "cp": ps.get_context_parallel_world_size,
    "tp_cp": ps.get_tensor_and_context_parallel_world_size,
    "tp_dp": ps.get_tensor_and_data_parallel_world_size,
    "tp_dp_cp": lambda: ps.get_tensor_and_data_parallel_world_size(with_context_parallel=True),
    "expt_tp": ps.get_expert_tensor_parallel_world_size,
    "ep": ps.get_expert_model_parallel_world_size,
    "tp_ep": ps.get_expert_tensor_and_model_parallel_world_size,
    "expt_dp": ps.get_expert_data_parallel_world_size,
}
RANK_GETTERS = {
    "tp": ps.get_tensor_model_parallel_rank,
    "pp": ps.get_pipeline_model_parallel_rank,
    "dp": ps.get_data_parallel_rank,
    "dp_cp": lambda: ps.get_data_parallel_rank(with_context_parallel=True),
    "cp": ps.get_context_parallel_rank,
    "tp_cp": ps.get_tensor_and_context_parallel_rank,
    "expt_tp": ps.get_expert_tensor_parallel_rank,
    "ep": ps.get_expert_model_parallel_rank,
    "tp_ep": ps.get_expert_tensor_and_model_parallel_rank,
    "expt_dp": ps.get_expert_data_parallel_rank,
}


def _report_groups(init_kwargs):
    """Rank function: initialise, then report every group's members and every accessor's answer."""
    ps.initialize_model_parallel(**init_kwargs)
    rank = dist.get_rank()
    members, rank_sums = {}, {}
    for kind, get_group in GROUP_GETTERS.items():
        group = get_group()
        members[kind] = None if group is None else dist.get_process_group_ranks(group)
        if group is not None:  # the group must also work as a communicator
            total = torch.tensor([rank])
            dist.all_reduce(total, group=group)
            rank_sums[kind] = int(total.item())
    return {
        "members": members,
        "rank_sums": rank_sums,
        "world_sizes": {kind: get() for kind, get in WORLD_SIZE_GETTERS.items()},
        "ranks": {kind: get() for kind, get in RANK_GETTERS.items()},
        "pipeline": {
            "first": ps.get_pipeline_model_parallel_first_rank(),
            "last": ps.get_pipeline_model_parallel_last_rank(),
            "next": ps.get_pipeline_model_parallel_next_rank(),
            "prev": ps.get_pipeline_model_parallel_prev_rank(),
            "is_first_stage": ps.is_pipeline_first_stage(),
            "is_last_stage": ps.is_pipeline_last_stage(),
            "virtual": (
                ps.get_virtual_pipeline_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_rank(),
            ),
        },
        "sources": {
            "tp": ps.get_tensor_model_parallel_src_rank(),
            "dp": ps.get_data_parallel_src_rank(),
            "dp_cp": ps.get_data_parallel_src_rank(with_context_parallel=True),
            "mp": ps.get_model_parallel_src_rank(),
        },
        "embedding": {
            "in_embedding_group": ps.is_rank_in_embedding_group(),
            "in_position_embedding_group": ps.is_rank_in_position_embedding_group(),
            "embedding_ranks": ps.get_embedding_group_ranks(),
        },
        "context_parallel_global_ranks": ps.get_context_parallel_global_ranks(),
        "initialized": ps.model_parallel_is_initialized(),
        # One distributed-optimizer instance: its partial data-parallel group is the whole data x context group.
        "partial_dp_is_dp_cp": ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
        is ps.get_data_parallel_group(with_context_parallel=True),
        "gloo_twins_are_the_groups": (
            ps.get_data_parallel_group_gloo() is ps.get_data_parallel_group(),
            ps.get_data_parallel_group_gloo(with_context_parallel=True)
            is ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_expert_data_parallel_group_gloo() is ps.get_expert_data_parallel_group(),
        ),
    }


def expected_report(layout: Layout, rank: int) -> dict:
    """What ``_report_groups`` must return on ``rank``, from the reference alone."""
    groups = {kind: reference_group_of(rank, layout.order, layout.dense_sizes, t) for kind, t in DENSE_KINDS.items()}
    groups.update(
        {kind: reference_group_of(rank, layout.order, layout.expert_sizes, t) for kind, t in EXPERT_KINDS.items()}
    )
    pipeline = groups["pp"]
    stage = pipeline.index(rank)
    embedding_ranks = [pipeline[0], pipeline[-1]] if len(pipeline) > 1 else [pipeline[0]]
    groups["embd"] = embedding_ranks if rank in embedding_ranks else None
    groups["pos_embd"] = [pipeline[0]] if stage == 0 else None
    return {
        "members": groups,
        "rank_sums": {kind: sum(group) for kind, group in groups.items() if group is not None},
        "world_sizes": {kind: len(groups[kind]) for kind in WORLD_SIZE_GETTERS},
        "ranks": {kind: groups[kind].index(rank) for kind in RANK_GETTERS},
        "pipeline": {
            "first": pipeline[0],
            "last": pipeline[-1],
            "next": pipeline[(stage + 1) % len(pipeline)],
            "prev": pipeline[(stage - 1) % len(pipeline)],
            "is_first_stage": stage == 0,
            "is_last_stage": stage == len(pipeline) - 1,
            "virtual": (None, None),
        },
        "sources": {"tp": groups["tp"][0], "dp": groups["dp"][0], "dp_cp": groups["dp_cp"][0], "mp": groups["mp"][0]},
        "embedding": {
            "in_embedding_group": rank in embedding_ranks,
            "in_position_embedding_group": stage == 0,
            "embedding_ranks": embedding_ranks,
        },
        "context_parallel_global_ranks": groups["cp"],
        "initialized": True,
        "partial_dp_is_dp_cp": True,
        "gloo_twins_are_the_groups": (True, True, True),
    }


LAYOUTS = [
    Layout(1),
    Layout(2, tp=2),
    Layout(4, tp=2, pp=2, order="tp-pp-dp"),
    Layout(8, tp=2, pp=2),
    Layout(8, tp=2, cp=2, pp=2),
    Layout(8, tp=2, pp=2, ep=2, etp=1),
    Layout(8, tp=2, ep=4, etp=2),
    Layout(8, cp=2, pp=2, ep=2),
    Layout(8, pp=4, order="tp-cp-ep-pp-dp"),
    Layout(8, tp=2, pp=2, order="pp-tp-dp"),  # tp not fastest: the TP source rank is not rank // tp * tp
]


@functools.lru_cache(maxsize=None)
def reports_for(layout: Layout):
    return run_distributed(layout.world_size, _report_groups, layout.init_kwargs())


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_real_groups_and_accessors_match_reference(layout):
    for rank, report in enumerate(reports_for(layout)):
        assert report == expected_report(layout, rank), f"rank {rank}"


@pytest.mark.parametrize("layout", [Layout(8, tp=2, pp=2), Layout(8, tp=2, cp=2, pp=2)], ids=str)
def test_default_order_rank_formula_on_real_ranks(layout):
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    for rank, report in enumerate(reports_for(layout)):
        r = report["ranks"]
        assert rank == r["tp"] + r["cp"] * tp + r["dp"] * tp * cp + r["pp"] * tp * cp * dp


def test_tp_pp_dp_rank_formula_on_real_ranks():
    layout = Layout(4, tp=2, pp=2, order="tp-pp-dp")
    for rank, report in enumerate(reports_for(layout)):
        r = report["ranks"]
        assert rank == r["tp"] + r["pp"] * layout.tp + r["dp"] * layout.tp * layout.pp


@pytest.mark.parametrize("layout", [Layout(8, tp=2, pp=2, ep=2, etp=1), Layout(8, tp=2, ep=4, etp=2)], ids=str)
def test_expert_rank_formula_on_real_ranks(layout):
    # The expert layout is tp-ep-dp-pp over expert-TP, EP, expert-DP and PP.
    etp, ep, edp = layout.expert_tp, layout.ep, layout.expert_dp
    for rank, report in enumerate(reports_for(layout)):
        r = report["ranks"]
        assert rank == r["expt_tp"] + r["ep"] * etp + r["expt_dp"] * etp * ep + r["pp"] * etp * ep * edp


# ---- virtual pipeline ------------------------------------------------------------------------------------------

VIRTUAL_CHUNKS = 3


def _virtual_pipeline_stages():
    """Rank function on 4 pipeline stages with 3 virtual chunks each: the stage predicates for every chunk."""
    ps.initialize_model_parallel(1, 4, VIRTUAL_CHUNKS)
    initial = (ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_rank())
    table = {}
    for current_chunk in range(VIRTUAL_CHUNKS):
        ps.set_virtual_pipeline_model_parallel_rank(current_chunk)
        assert ps.get_virtual_pipeline_model_parallel_rank() == current_chunk
        for vp_stage in (None, *range(VIRTUAL_CHUNKS)):
            for ignore_virtual in (False, True):
                table[current_chunk, vp_stage, ignore_virtual] = (
                    ps.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
                    ps.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
                    ps.is_rank_in_embedding_group(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
                )
    # Without a virtual world size the chunk is irrelevant again.
    ps.set_virtual_pipeline_model_parallel_world_size(None)
    ps.set_virtual_pipeline_model_parallel_rank(1)
    without_virtual = (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    return ps.get_pipeline_model_parallel_rank(), initial, table, without_virtual


def test_virtual_pipeline_stage_predicates():
    results = run_distributed(4, _virtual_pipeline_stages)
    for rank, (stage, initial, table, without_virtual) in enumerate(results):
        assert stage == rank  # tp=1, dp=1: the pipeline is the whole world
        assert initial == (VIRTUAL_CHUNKS, 0)
        assert without_virtual == (stage == 0, stage == 3)
        for (current_chunk, vp_stage, ignore_virtual), answers in table.items():
            chunk = current_chunk if vp_stage is None else vp_stage
            first = stage == 0 and (ignore_virtual or chunk == 0)
            last = stage == 3 and (ignore_virtual or chunk == VIRTUAL_CHUNKS - 1)
            in_embedding = first or last or (ignore_virtual and stage in (0, 3))
            key = f"rank {rank}, chunk {current_chunk}, vp_stage {vp_stage}, ignore_virtual {ignore_virtual}"
            assert answers == (first, last, in_embedding), key


# ---- destroy, re-initialise, custom embedding ranks, mpu -------------------------------------------------------


def _embedding_on_last_stage(pipeline_ranks):
    return [pipeline_ranks[-1]]


def _position_embedding_on_every_stage(pipeline_ranks):
    return list(pipeline_ranks)


def _destroy_then_reinitialise():
    from megatron.core import mpu

    mpu.initialize_model_parallel(2, 2)
    pipeline = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    first = (ps.get_tensor_model_parallel_world_size(), pipeline)
    ps.set_tensor_model_parallel_world_size(7)
    ps.destroy_model_parallel()
    after_destroy = (
        ps.model_parallel_is_initialized(),
        ps.get_tensor_model_parallel_world_size(),  # override cleared, no groups: 1
        ps.get_tensor_model_parallel_group(check_initialized=False),
    )
    ps.initialize_model_parallel(
        1,
        4,
        order="tp-pp-dp",
        get_embedding_ranks=_embedding_on_last_stage,
        get_position_embedding_ranks=_position_embedding_on_every_stage,
    )
    second = (
        ps.get_tensor_model_parallel_world_size(),
        dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        None if ps.get_embedding_group() is None else dist.get_process_group_ranks(ps.get_embedding_group()),
        dist.get_process_group_ranks(ps.get_position_embedding_group()),
        ps.is_rank_in_embedding_group(ignore_virtual=True),
        ps.is_rank_in_position_embedding_group(),
    )
    return first, after_destroy, second


def test_destroy_then_reinitialise_with_another_layout():
    results = run_distributed(4, _destroy_then_reinitialise)
    for rank, (first, after_destroy, second) in enumerate(results):
        assert first == (2, [rank % 2, rank % 2 + 2])
        assert after_destroy == (False, 1, None)
        embedding = [3] if rank == 3 else None
        assert second == (1, [0, 1, 2, 3], embedding, [0, 1, 2, 3], rank == 3, True)


def test_mpu_is_parallel_state():
    import megatron.core.mpu as mpu_by_path
    from megatron.core import mpu

    assert mpu is ps
    assert mpu_by_path is ps


# ---- without groups: fallbacks, overrides, and errors ----------------------------------------------------------


@pytest.fixture
def clean_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


def test_before_initialisation(clean_state):
    assert not ps.model_parallel_is_initialized()
    assert ps.is_unitialized()
    # Layers work without groups as single-rank modules: sizes 1, ranks 0.
    assert [get() for get in WORLD_SIZE_GETTERS.values()] == [1] * len(WORLD_SIZE_GETTERS)
    assert [get() for get in RANK_GETTERS.values()] == [0] * len(RANK_GETTERS)
    assert ps.get_context_parallel_global_ranks() == [0]
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    not_initialized = r"model parallel groups are not initialized; call initialize_model_parallel\(\) first"
    for needs_groups in (
        ps.get_tensor_model_parallel_group,
        ps.get_data_parallel_group,
        ps.get_tensor_model_parallel_src_rank,
        ps.get_data_parallel_src_rank,
        ps.get_pipeline_model_parallel_first_rank,
        ps.get_process_group_collection,
    ):
        with pytest.raises(RuntimeError, match=not_initialized):
            needs_groups()


def test_size_and_rank_overrides_are_cleared_by_destroy(clean_state):
    ps.set_tensor_model_parallel_world_size(4)
    ps.set_tensor_model_parallel_rank(3)
    ps.set_pipeline_model_parallel_world_size(2)
    ps.set_pipeline_model_parallel_rank(1)
    assert ps.get_tensor_model_parallel_world_size() == 4
    assert ps.get_tensor_model_parallel_rank() == 3
    assert (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()) == (False, True)
    ps.set_pipeline_model_parallel_rank(0)
    assert (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()) == (True, False)
    ps.set_tensor_model_parallel_rank(None)
    assert ps.get_tensor_model_parallel_rank() == 0
    ps.set_virtual_pipeline_model_parallel_world_size(2)
    ps.set_virtual_pipeline_model_parallel_rank(1)
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    assert ps.get_virtual_pipeline_model_parallel_rank() == 1
    ps.destroy_model_parallel()
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_pipeline_model_parallel_rank() == 0
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    assert ps.get_virtual_pipeline_model_parallel_rank() is None


def test_initialize_before_torch_distributed_is_an_error(clean_state, monkeypatch):
    # The pytest process never joins a process group, but pin that down rather than rely on it.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs torch.distributed: call torch.distributed.init_process_group"):
        ps.initialize_model_parallel(2)
    assert not ps.model_parallel_is_initialized()


def test_partial_data_parallel_needs_context_parallel(clean_state):
    with pytest.raises(ValueError, match=r"partial_data_parallel=True needs with_context_parallel=True"):
        ps.get_data_parallel_group(partial_data_parallel=True)


# Each case runs on 4 ranks: (initialize_model_parallel kwargs, exception type, message pattern).
INITIALIZE_ERRORS = {
    "tp does not divide world": (
        dict(tensor_model_parallel_size=3),
        ValueError,
        r"world size \(4\) is not divisible by tensor_model_parallel_size \(3\) x pipeline_model_parallel_size \(1\) "
        r"x context_parallel_size \(1\) = 3",
    ),
    "tp*pp*cp exceeds world": (
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2),
        ValueError,
        r"world size \(4\) is not divisible by tensor_model_parallel_size \(2\) x pipeline_model_parallel_size \(2\) "
        r"x context_parallel_size \(2\) = 8",
    ),
    "ep does not divide world": (
        dict(expert_model_parallel_size=3),
        ValueError,
        r"world size \(4\) is not divisible by expert_tensor_parallel_size \(1\) x expert_model_parallel_size \(3\) "
        r"x pipeline_model_parallel_size \(1\) = 3",
    ),
    "etp*ep exceeds world": (
        dict(expert_model_parallel_size=2, expert_tensor_parallel_size=4),
        ValueError,
        r"world size \(4\) is not divisible by expert_tensor_parallel_size \(4\) x expert_model_parallel_size \(2\) "
        r"x pipeline_model_parallel_size \(1\) = 8",
    ),
    "unknown order token": (
        dict(order="tp-cp-ep-dp-xp"),
        ValueError,
        r"unknown token 'xp' in order 'tp-cp-ep-dp-xp'; valid tokens are tp, cp, ep, dp, pp",
    ),
    "duplicated order token": (
        dict(order="tp-dp-tp-pp"),
        ValueError,
        r"order 'tp-dp-tp-pp' names \['tp'\] more than once",
    ),
    "order omits dp of size 4": (
        dict(order="tp-pp"),
        ValueError,
        r"order 'tp-pp' omits 'dp' but its size is 4; add it to the order",
    ),
    "order omits cp of size 2": (
        dict(context_parallel_size=2, order="tp-dp-pp"),
        ValueError,
        r"order 'tp-dp-pp' omits 'cp' but its size is 2; add it to the order",
    ),
    "order omits ep of size 2": (
        dict(expert_model_parallel_size=2, order="tp-cp-dp-pp"),
        ValueError,
        r"order 'tp-cp-dp-pp' omits 'ep' but its size is 2; add it to the order",
    ),
    "zero tp": (
        dict(tensor_model_parallel_size=0),
        ValueError,
        r"tensor_model_parallel_size must be a positive integer, got 0",
    ),
    "negative pp": (
        dict(pipeline_model_parallel_size=-1),
        ValueError,
        r"pipeline_model_parallel_size must be a positive integer, got -1",
    ),
    "zero cp": (dict(context_parallel_size=0), ValueError, r"context_parallel_size must be a positive integer, got 0"),
    "zero ep": (
        dict(expert_model_parallel_size=0),
        ValueError,
        r"expert_model_parallel_size must be a positive integer, got 0",
    ),
    "zero etp": (
        dict(expert_tensor_parallel_size=0),
        ValueError,
        r"expert_tensor_parallel_size must be a positive integer, got 0",
    ),
    "float tp": (
        dict(tensor_model_parallel_size=2.0),
        ValueError,
        r"tensor_model_parallel_size must be a positive integer, got 2.0",
    ),
    "virtual pipeline without pipeline": (
        dict(virtual_pipeline_model_parallel_size=2),
        ValueError,
        r"virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1 \(got 1\)",
    ),
    "zero virtual pipeline": (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=0),
        ValueError,
        r"virtual_pipeline_model_parallel_size must be >= 1, got 0",
    ),
    "hierarchical context parallel sizes": (
        dict(context_parallel_size=1, hierarchical_context_parallel_sizes=[2, 2]),
        ValueError,
        r"hierarchical_context_parallel_sizes=\[2, 2\] multiply to 4, not context_parallel_size=1",
    ),
    "several distributed optimizer instances": (
        dict(num_distributed_optimizer_instances=2),
        ValueError,
        r"not supported yet: several distributed-optimizer instances \(num_distributed_optimizer_instances=2\)",
    ),
    "hybrid context parallel": (
        dict(hybrid_context_parallel=True),
        ValueError,
        r"not supported yet: hybrid context parallelism \(hybrid_context_parallel=True\)",
    ),
    "gtp weight rematerialisation": (
        dict(gtp_remat_size=2),
        ValueError,
        r"not supported yet: GTP weight rematerialisation \(gtp_remat_size=2\)",
    ),
    "expert gtp weight rematerialisation": (
        dict(expert_gtp_remat_size=2),
        ValueError,
        r"not supported yet: expert GTP weight rematerialisation \(expert_gtp_remat_size=2\)",
    ),
    "rank offset": (
        dict(rank_offset=2),
        ValueError,
        r"not supported yet: a layout over part of the world \(rank_offset=2\)",
    ),
    "local world size": (
        dict(local_world_size=2),
        ValueError,
        r"not supported yet: a layout over part of the world \(local_world_size=2\)",
    ),
    "expert data-parallel size differs without pp last": (
        # dense dp = 4 / 2 = 2, expert dp = 4 / (2 * 2) = 1, and pp is not the slowest axis.
        dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2, order="tp-cp-ep-pp-dp"),
        ValueError,
        r"order 'tp-cp-ep-pp-dp' does not end with 'pp', so the expert data-parallel size \(1\) must equal the "
        r"data-parallel size \(2\) when pipeline_model_parallel_size is 2",
    ),
    "expert pipeline groups differ from dense ones": (
        # Both data-parallel sizes are 1, but pp strides over tp=2 in the dense layout and over expert-TP 1 in the
        # expert one: stage neighbours would disagree between attention and MoE layers.
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            order="tp-pp-cp-ep-dp",
        ),
        ValueError,
        r"order 'tp-pp-cp-ep-dp' gives the expert layers pipeline groups \[\[0, 1\], \[2, 3\]\] but the dense layers "
        r"\[\[0, 2\], \[1, 3\]\]",
    ),
}


def _collect_initialize_errors():
    """Rank function: try every bad call, then a double initialisation; report (type, message, initialized)."""
    outcomes = {}
    for name, (kwargs, _, _) in INITIALIZE_ERRORS.items():
        try:
            ps.initialize_model_parallel(**kwargs)
            outcomes[name] = ("no error", "", ps.model_parallel_is_initialized())
            ps.destroy_model_parallel()
        except Exception as error:  # noqa: BLE001 - the parent checks the type
            outcomes[name] = (type(error).__name__, str(error), ps.model_parallel_is_initialized())
    # A rejected call leaves nothing half-made: a good one still works, and a second one is refused.
    ps.initialize_model_parallel(2, 2)
    try:
        ps.initialize_model_parallel(2, 2)
        outcomes["double initialisation"] = ("no error", "", True)
    except Exception as error:  # noqa: BLE001
        outcomes["double initialisation"] = (type(error).__name__, str(error), ps.model_parallel_is_initialized())
    return outcomes


@pytest.fixture(scope="module")
def initialize_errors():
    results = run_distributed(4, _collect_initialize_errors)
    assert all(result == results[0] for result in results), "ranks disagree about the errors"
    return results[0]


@pytest.mark.parametrize("case", list(INITIALIZE_ERRORS))
def test_initialize_rejects_bad_layout(initialize_errors, case):
    _, error_type, pattern = INITIALIZE_ERRORS[case]
    kind, message, initialized = initialize_errors[case]
    assert kind == error_type.__name__, message
    assert re.search(pattern, message), message
    assert not initialized


def test_double_initialisation_is_refused_and_keeps_the_groups(initialize_errors):
    kind, message, initialized = initialize_errors["double initialisation"]
    assert kind == "RuntimeError"
    assert re.search(r"model parallel groups are already initialized; call destroy_model_parallel\(\) first", message)
    assert initialized


def _open_fds_and_threads_across_init_destroy_cycles(cycles):
    def counts():
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    # One warm-up cycle first: the first collective may start long-lived helper threads of its own.
    ps.initialize_model_parallel(2, 2)
    ps.destroy_model_parallel()
    before = counts()
    for _ in range(cycles):
        ps.initialize_model_parallel(2, 2)
        dist.barrier(group=ps.get_tensor_model_parallel_group())  # use the groups, so their transports exist
        ps.destroy_model_parallel()
    return before, counts()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_initialise_and_destroy_repeatedly_leaks_no_files_or_threads():
    # Each group holds sockets and gloo threads until torch.distributed destroys it; before destroy_model_parallel
    # destroyed its groups, every cycle left ~70 file descriptors behind on each rank.
    cycles = 20
    for (fds_before, threads_before), (fds_after, threads_after) in run_distributed(
        4, _open_fds_and_threads_across_init_destroy_cycles, cycles
    ):
        # Less than one per cycle: a descriptor closed lazily may move the count by one, a leak moves it by `cycles`.
        assert fds_after - fds_before < cycles and threads_after - threads_before < cycles
