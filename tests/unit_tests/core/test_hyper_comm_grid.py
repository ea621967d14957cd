"""HyperCommGrid: its rank enumeration against RankGenerator and a by-hand reference, its errors, and real gloo
groups on 1, 2 and 4 ranks (members, all-reduce, agreement with parallel_state, rank offsets, views, destroy)."""

import itertools
import re

import pytest
import torch
import torch.distributed as dist

from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.rank_generator import RankGenerator
from tests.unit_tests.test_utilities import run_distributed


@pytest.fixture
def world8(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")


def _reference_groups(shape, names, dims, offset=0):
    """Groups by hand: rank = offset + sum(coord[i] * prod(shape[:i])); members agree outside ``dims``; inside a
    group the grid's first name counts fastest; groups and members listed by ascending first rank."""
    strides = [1]
    for size in shape[:-1]:
        strides.append(strides[-1] * size)
    groups = {}
    for coords in itertools.product(*[range(s) for s in shape]):
        rank = offset + sum(c * s for c, s in zip(coords, strides))
        outside = tuple(c for c, n in zip(coords, names) if n not in dims)
        groups.setdefault(outside, []).append(rank)
    return sorted(sorted(g) for g in groups.values())


@pytest.mark.parametrize(
    "shape, names",
    [([2, 2, 2], ["tp", "cp", "dp"]), ([2, 1, 2, 2], ["tp", "cp", "dp", "pp"]), ([3, 2, 1], ["a", "b", "c"])],
)
def test_enumeration_matches_reference_for_every_combination(monkeypatch, shape, names):
    monkeypatch.setenv("WORLD_SIZE", "16")
    grid = HyperCommGrid(shape, names)
    for count in range(1, len(names) + 1):
        for dims in itertools.combinations(names, count):
            for spelled in (list(dims), list(reversed(dims))):
                enum = grid.get_rank_enum(spelled)
                assert sorted(enum) == enum, "groups are listed by first rank"
                assert enum == _reference_groups(shape, names, dims), spelled


@pytest.mark.parametrize("tokens", ["tp", "cp", "dp", "pp", "tp-pp", "tp-cp", "dp-cp", "tp-cp-dp-pp"])
def test_enumeration_matches_rank_generator(monkeypatch, tokens):
    monkeypatch.setenv("WORLD_SIZE", "16")
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    grid = HyperCommGrid([2, 2, 2, 2], ["tp", "cp", "dp", "pp"])
    assert grid.get_rank_enum(tokens.split("-")) == generator.get_ranks(tokens)


def test_named_order_and_offset(world8):
    grid = HyperCommGrid([2, 2, 2], ["a", "b", "c"])
    # _gen_rank_enum takes the dimensions as given: the last named varies fastest.
    assert grid._gen_rank_enum(["a", "b"]) == [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert grid.get_rank_enum(["b", "a"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid._order_dims_for(grid.dim_names, ["a", "c"]) == (["c", "a"], "c-a")
    offset = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4)
    assert offset.get_rank_enum("dp") == [[4, 6], [5, 7]]
    assert offset.size == 4 and offset.shape == [2, 2] and offset.backend is None


def test_world_size_from_env_then_from_torch(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert HyperCommGrid([2, 4], ["tp", "dp"]).size == 8
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match=re.escape("needs 8 ranks from rank offset 0, but the world has 4")):
        HyperCommGrid([2, 4], ["tp", "dp"])


def test_construction_errors(world8, monkeypatch):
    with pytest.raises(ValueError, match=re.escape("len(shape) [2, 2] != len(dim_names) ['tp']")):
        HyperCommGrid([2, 2], ["tp"])
    with pytest.raises(ValueError, match=re.escape("duplicate dim_names: ['tp', 'tp']; name each dimension once")):
        HyperCommGrid([2, 2], ["tp", "tp"])
    with pytest.raises(ValueError, match=re.escape("HyperCommGrid shape must be positive ints, got [2, 0]")):
        HyperCommGrid([2, 0], ["tp", "dp"])
    with pytest.raises(ValueError, match="rank_offset must be non-negative, got -1"):
        HyperCommGrid([2], ["tp"], rank_offset=-1)
    with pytest.raises(RuntimeError, match=re.escape("Grid shape [2, 4] is over sized: it needs 8 ranks from rank")):
        HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=1)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match="cannot tell the world size: call torch.distributed.init_process_group"):
        HyperCommGrid([1], ["tp"])


def test_lookup_errors(world8):
    grid = HyperCommGrid([2, 4], ["tp", "dp"])
    with pytest.raises(KeyError, match=re.escape("Process group for dp-tp hasn't been created; call create_pg")):
        grid.get_pg(["tp", "dp"])
    with pytest.raises(ValueError, match=re.escape("'ep' is not in view 'base' with dim_names ['tp', 'dp']")):
        grid.get_rank_enum("ep")
    with pytest.raises(ValueError, match=re.escape("dimensions ['tp', 'tp'] name one dimension twice")):
        grid.get_rank_enum(["tp", "tp"])
    with pytest.raises(ValueError, match="no dimension named for a process group of view 'base'"):
        grid.get_rank_enum([])
    with pytest.raises(KeyError, match=re.escape("View 'expert' is not registered. Registered views: ['base']")):
        grid.get_pg("tp", view="expert")


def test_register_view_errors(world8):
    grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    with pytest.raises(ValueError, match=re.escape("View 'e': len(shape) [2, 4] != len(dim_names) ['ep']")):
        grid.register_view("e", [2, 4], ["ep"])
    with pytest.raises(ValueError, match="View 'e' has duplicate dim_names"):
        grid.register_view("e", [2, 4], ["ep", "ep"])
    with pytest.raises(ValueError, match=re.escape("View 'e' shape must be positive ints, got [-2, -4]")):
        grid.register_view("e", [-2, -4], ["ep", "edp"])
    with pytest.raises(ValueError, match=re.escape("View 'e' shape [2, 2] has size 4, but the grid size is 8")):
        grid.register_view("e", [2, 2], ["ep", "edp"])
    with pytest.raises(ValueError, match=re.escape("View 'e' has duplicate shared_dims: ['pp', 'pp']")):
        grid.register_view("e", [4, 2], ["ep", "pp"], shared_dims=["pp", "pp"])
    with pytest.raises(ValueError, match="Shared dim 'cp' of view 'e' is not in the base view"):
        grid.register_view("e", [4, 2], ["ep", "cp"], shared_dims=["cp"])
    with pytest.raises(ValueError, match="Shared dim 'pp' of view 'e' is not in the view's dim_names"):
        grid.register_view("e", [4, 2], ["ep", "edp"], shared_dims=["pp"])
    with pytest.raises(ValueError, match=re.escape("Shared dim 'pp' has different membership across views: the base")):
        grid.register_view("e", [2, 4], ["pp", "ep"], shared_dims=["pp"])
    with pytest.raises(ValueError, match=re.escape("Shared dim 'dp' has different membership across views")):
        grid.register_view("e", [2, 2, 2], ["dp", "tp", "pp"], shared_dims=["pp", "dp"])
    grid.register_view("e", [2, 2, 2], ["etp", "ep", "pp"], shared_dims=["pp"])
    with pytest.raises(ValueError, match="View 'e' is already registered; pick another view name"):
        grid.register_view("e", [4, 2], ["ep", "pp"])
    missing = "Process group ep for view 'e' hasn't been created; call create_pg('ep', view='e') first"
    with pytest.raises(KeyError, match=re.escape(missing)):
        grid.get_pg("ep", view="e")


def _groups_on_rank(world_size):
    """Every group of a [2, 1, world/2] (tp, cp, dp) grid on this rank: its members, an all-reduce over it, and
    whether get_pg returns the created group; then the duplicate-creation error; then destroy."""
    tp = 2 if world_size > 1 else 1
    grid = HyperCommGrid([tp, 1, world_size // tp], ["tp", "cp", "dp"], backend="gloo")
    report = {}
    for dims in (["tp"], ["cp"], ["dp"], ["dp", "tp"], ["tp", "cp", "dp"]):
        group = grid.create_pg(dims, group_desc="TEST")
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total, group=group)
        mine = [g for g in grid.get_rank_enum(dims) if dist.get_rank() in g]
        report["-".join(dims)] = (dist.get_process_group_ranks(group), mine, total.item(), grid.get_pg(dims) is group)
    with pytest.raises(KeyError, match=re.escape("Process group ['tp', 'dp'] has already been created; a grid")):
        grid.create_pg(["tp", "dp"])
    grid.destroy()
    report["after_destroy"] = grid._pgs
    return report


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_real_groups(world_size):
    for rank, report in enumerate(run_distributed(world_size, _groups_on_rank, world_size)):
        assert report.pop("after_destroy") == {}
        for dims, (members, mine, total, same) in report.items():
            assert [members] == mine, (rank, dims)
            assert rank in members and total == sum(members) and same, (rank, dims)
        if world_size == 4:
            assert report["tp"][0] == [rank - rank % 2, rank - rank % 2 + 1]
            assert report["dp"][0] == [rank % 2, rank % 2 + 2]
            assert report["dp-tp"][0] == [0, 1, 2, 3]


def _grid_and_parallel_state(order):
    """On 4 ranks: TP2 x PP2 groups from parallel_state and from a grid laid out the same way."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order=order)
    names = order.split("-")
    sizes = {"tp": 2, "cp": 1, "ep": 1, "dp": 1, "pp": 2}
    grid = HyperCommGrid([sizes[n] for n in names], names)
    ranks = dist.get_process_group_ranks
    pairs = {
        "tp": (ranks(grid.create_pg("tp")), ranks(ps.get_tensor_model_parallel_group())),
        "pp": (ranks(grid.create_pg("pp")), ranks(ps.get_pipeline_model_parallel_group())),
        "mp": (ranks(grid.create_pg(["tp", "pp"])), ranks(ps.get_model_parallel_group())),
    }
    grid.destroy()
    ps.destroy_model_parallel()
    return pairs


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-pp-dp-cp-ep"])
def test_matches_parallel_state(order):
    for pairs in run_distributed(4, _grid_and_parallel_state, order):
        for kind, (from_grid, from_parallel_state) in pairs.items():
            assert from_grid == from_parallel_state, kind


def _offset_grid_and_view():
    """On 4 ranks: a 2-rank grid at offset 2, and a full grid with an expert view sharing pp."""
    part = HyperCommGrid([2], ["tp"], rank_offset=2)
    part_group = part.create_pg("tp")
    part_members = dist.get_process_group_ranks(part_group) if part_group is not None else None
    grid = HyperCommGrid([2, 1, 2], ["tp", "dp", "pp"])
    grid.register_view("expert", [1, 2, 2], ["etp", "ep", "pp"], shared_dims=["pp"])
    base_pp = grid.create_pg("pp")
    ep = grid.create_pg(["ep", "etp"], view="expert")
    result = {
        "in_part": part.is_current_rank_in_grid(),
        "part": part_members,
        "pp_shared": grid.get_pg("pp", view="expert") is base_pp,
        "ep": dist.get_process_group_ranks(ep),
        "keys": sorted(map(str, grid._pgs)),
    }
    with pytest.raises(KeyError, match=re.escape("Process group pp has already been created")):
        grid.create_pg("pp", view="expert")
    part.destroy()
    grid.destroy()
    return result


def test_rank_offset_and_views():
    for rank, result in enumerate(run_distributed(4, _offset_grid_and_view)):
        assert result["in_part"] == (rank >= 2)
        assert result["part"] == ([2, 3] if rank >= 2 else None)
        assert result["pp_shared"]
        assert result["ep"] == ([0, 1] if rank < 2 else [2, 3])
        assert result["keys"] == ["('expert', ('ep', 'etp'))", "pp"]
