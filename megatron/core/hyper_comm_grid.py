"""HyperCommGrid: Megatron's n-dimensional grid of process groups over named dimensions.

A grid of shape ``[2, 2, 4]`` named ``["tp", "cp", "dp"]`` lays its ranks out as
``initialize_model_parallel(order="tp-cp-dp")`` does: the first name varies fastest. A group over any combination of
dimensions is made on request (``create_pg``) and fetched later (``get_pg``); other factorizations of the same ranks
(an expert layout, say) are registered as views. The rank arithmetic is ``rank_generator``'s; the groups come from
``torch.distributed.new_subgroups_by_enumeration``, as in Megatron, so every rank of the world must call
``create_pg`` for the same dimensions in the same order.
"""

import logging
import numbers
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch.distributed as dist

from megatron.core.rank_generator import enumerate_rank_groups

logger = logging.getLogger(__name__)

_BASE_VIEW_NAME = "base"

Dims = Union[str, List[str]]
# Base-view groups are keyed "dp-tp"; a view's own groups (view name, ("ep", "expt_tp")).
GroupKey = Union[str, Tuple[str, Tuple[str, ...]]]


@dataclass
class _RankViewSpec:
    """One factorization of the grid's ranks: its name, shape and dimension names (first varies fastest), and the
    dimensions whose groups are the base view's (``shared_dims``)."""

    name: str
    shape: List[int]
    dim_names: List[str]
    shared_dims: List[str]


def _world_size() -> int:
    # WORLD_SIZE first, as in Megatron: it lets a grid be laid out (and its enumerations checked) with no process
    # group, and launchers (torchrun, SLURM wrappers) set it to the world torch.distributed will have.
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if dist.is_initialized():
        return dist.get_world_size()
    raise RuntimeError(
        "HyperCommGrid cannot tell the world size: call torch.distributed.init_process_group first, or set the "
        "WORLD_SIZE environment variable"
    )


def _check_factorization(what: str, shape: List[int], dim_names: List[str]) -> None:
    if len(shape) != len(dim_names):
        raise ValueError(f"{what}: len(shape) {shape} != len(dim_names) {dim_names}; give one name per dimension")
    if len(set(dim_names)) != len(dim_names):
        raise ValueError(f"{what} has duplicate dim_names: {dim_names}; name each dimension once")
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s <= 0 for s in shape):
        raise ValueError(f"{what} shape must be positive ints, got {shape}")


def _is_member(group: Optional[dist.ProcessGroup]) -> bool:
    non_member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return group is not None and group is not non_member


class HyperCommGrid:
    """An n-dimensional grid of ranks with named dimensions, from which process groups are created.

    Args:
        shape: the size of each dimension.
        dim_names: one name per dimension; the first varies fastest (Megatron's ``order`` string read left to right).
        rank_offset: the grid's first global rank, for a grid that covers only part of the world.
        backend: the backend of the groups it creates (None: the default backend).

    A group over a set of dimensions can be created once (``create_pg``; its keyword arguments such as
    ``timeout``, ``pg_options`` and ``group_desc`` go to torch), then fetched with ``get_pg``. Its key lists the
    dimensions slowest first (``["tp", "dp"]`` on ``["tp", "cp", "dp"]`` is ``"dp-tp"``), so the order in which a
    caller names them does not matter.
    """

    def __init__(
        self, shape: List[int], dim_names: List[str], rank_offset: int = 0, backend: Optional[str] = None
    ) -> None:
        _check_factorization("HyperCommGrid", shape, dim_names)
        if rank_offset < 0:
            raise ValueError(f"HyperCommGrid rank_offset must be non-negative, got {rank_offset}")
        world_size = _world_size()
        self.rank_offset = rank_offset
        self.size = 1
        for s in shape:
            self.size *= int(s)
        if self.size > world_size - rank_offset:
            raise RuntimeError(
                f"Grid shape {list(shape)} is over sized: it needs {self.size} ranks from rank offset {rank_offset}, "
                f"but the world has {world_size} ranks; shrink the grid, lower rank_offset or launch more ranks"
            )
        self.shape = list(shape)
        self.dim_names = list(dim_names)
        self.backend = backend
        self._views: Dict[str, _RankViewSpec] = {
            _BASE_VIEW_NAME: _RankViewSpec(_BASE_VIEW_NAME, self.shape[:], self.dim_names[:], [])
        }
        self._pgs: Dict[GroupKey, Optional[dist.ProcessGroup]] = {}

    def register_view(
        self, name: str, shape: List[int], dim_names: List[str], shared_dims: Optional[List[str]] = None
    ) -> None:
        """Register another factorization of the grid's ranks (e.g. ``[etp, ep, pp]`` beside ``[tp, dp, pp]``).

        ``shared_dims`` name dimensions that both views have and that give the same rank groups in both; a group
        over shared dimensions only is the base view's group, created once.
        """
        what = f"View {name!r}"
        if name in self._views:
            raise ValueError(f"{what} is already registered; pick another view name")
        _check_factorization(what, shape, dim_names)
        view_size = 1
        for s in shape:
            view_size *= int(s)
        if view_size != self.size:
            raise ValueError(
                f"{what} shape {list(shape)} has size {view_size}, but the grid size is {self.size}; a view "
                "factorizes the same ranks"
            )
        shared_dims = list(shared_dims or [])
        if len(set(shared_dims)) != len(shared_dims):
            raise ValueError(f"{what} has duplicate shared_dims: {shared_dims}; list each shared dimension once")
        for dim in shared_dims:
            if dim not in self.dim_names:
                raise ValueError(f"Shared dim {dim!r} of view {name!r} is not in the base view {self.dim_names}")
            if dim not in dim_names:
                raise ValueError(f"Shared dim {dim!r} of view {name!r} is not in the view's dim_names {dim_names}")
        # Equal groups for each shared dim give them equal strides in both views, hence equal groups (in the same
        # order) for any combination of them: checking one dim at a time is enough.
        for dim in shared_dims:
            base_enum = self.get_rank_enum(dim)
            view_enum = self._gen_rank_enum_for(shape, dim_names, [dim])
            if base_enum != view_enum:
                raise ValueError(
                    f"Shared dim {dim!r} has different membership across views: the base view groups ranks as "
                    f"{base_enum}, view {name!r} as {view_enum}; reorder the view's dim_names or drop {dim!r} from "
                    "shared_dims"
                )
        self._views[name] = _RankViewSpec(name, list(shape), list(dim_names), shared_dims)

    def create_pg(self, dims: Dims, *, view: Optional[str] = None, **kwargs: Any) -> Optional[dist.ProcessGroup]:
        """Create the groups over ``dims`` (one name or a list) and return this rank's (None outside the grid).

        Keyword arguments (``timeout``, ``pg_options``, ``group_desc``, ...) go to
        ``torch.distributed.new_subgroups_by_enumeration``. Creating the same group twice is an error: the grid
        cannot tell whether the options match the first call's.
        """
        view_spec = self._resolve_view(view)
        ordered_dims, _ = self._order_dims_for_view(view_spec, dims)
        key, enum_view, enum_dims = self._canonical_pg_key_and_enum_view(view_spec, ordered_dims)
        if key in self._pgs:
            where = "" if isinstance(key, str) else f" for view {view_spec.name!r}"
            raise KeyError(
                f"Process group {dims}{where} has already been created; a grid creates each group once because it "
                f"cannot check that new options match the first ones: fetch it with get_pg"
            )
        rank_enum = self._gen_rank_enum_for(enum_view.shape, enum_view.dim_names, enum_dims)
        group, _ = dist.new_subgroups_by_enumeration(rank_enum, backend=self.backend, **kwargs)
        if dist.is_initialized() and dist.get_rank() == 0:
            logger.info("HyperCommGrid created process group %s with enumeration %s", key, rank_enum)
        self._pgs[key] = group
        return group

    def get_pg(self, dims: Dims, *, view: Optional[str] = None) -> Optional[dist.ProcessGroup]:
        """This rank's group over ``dims``, made earlier by ``create_pg`` (the dimensions in any order)."""
        view_spec = self._resolve_view(view)
        ordered_dims, _ = self._order_dims_for_view(view_spec, dims)
        key, _, _ = self._canonical_pg_key_and_enum_view(view_spec, ordered_dims)
        if key not in self._pgs:
            if isinstance(key, str):
                raise KeyError(f"Process group for {key} hasn't been created; call create_pg({dims!r}) first")
            raise KeyError(
                f"Process group {dims} for view {view_spec.name!r} hasn't been created; call "
                f"create_pg({dims!r}, view={view_spec.name!r}) first"
            )
        return self._pgs[key]

    def get_rank_enum(self, dims: Dims, *, view: Optional[str] = None) -> List[List[int]]:
        """The rank groups ``create_pg(dims, view=view)`` makes (global ranks), e.g. to derive embedding groups."""
        view_spec = self._resolve_view(view)
        ordered_dims, _ = self._order_dims_for_view(view_spec, dims)
        return self._gen_rank_enum_for(view_spec.shape, view_spec.dim_names, ordered_dims)

    def destroy(self) -> None:
        """Destroy every group of this grid that this rank belongs to (a group shared by views once), and forget
        them all."""
        destroyed = set()
        for group in self._pgs.values():
            if _is_member(group) and id(group) not in destroyed:
                dist.destroy_process_group(group)
                destroyed.add(id(group))
        self._pgs.clear()

    def is_current_rank_in_grid(self) -> bool:
        """Whether this rank lies in ``[rank_offset, rank_offset + size)``."""
        return self.rank_offset <= dist.get_rank() < self.rank_offset + self.size

    def _gen_rank_enum(self, dims: List[str]) -> List[List[int]]:
        """Rank groups over ``dims`` of the base view, the LAST of ``dims`` varying fastest inside a group
        (``create_pg`` first orders the dimensions slowest first, so its groups count in grid order)."""
        return self._gen_rank_enum_for(self.shape, self.dim_names, dims)

    def _gen_rank_enum_for(self, shape: List[int], dim_names: List[str], dims: List[str]) -> List[List[int]]:
        group_axes = [dim_names.index(d) for d in reversed(dims)]
        return enumerate_rank_groups([int(s) for s in shape], group_axes, self.rank_offset)

    def _order_dims_for(self, dim_names: List[str], dims: Dims) -> Tuple[List[str], str]:
        """``dims`` ordered slowest first against ``dim_names``, and the key that order spells."""
        if isinstance(dims, str):
            ordered = [dims]
        else:
            slowest_first = dim_names[::-1]
            ordered = sorted(dims, key=slowest_first.index)
        return ordered, "-".join(ordered)

    def _resolve_view(self, view: Optional[str]) -> _RankViewSpec:
        name = _BASE_VIEW_NAME if view is None else view
        if name not in self._views:
            raise KeyError(
                f"View {name!r} is not registered. Registered views: {sorted(self._views)}; call register_view first"
            )
        return self._views[name]

    def _order_dims_for_view(self, view: _RankViewSpec, dims: Dims) -> Tuple[List[str], str]:
        requested = [dims] if isinstance(dims, str) else list(dims)
        if not requested:
            raise ValueError(f"no dimension named for a process group of view {view.name!r}; name at least one")
        for dim in requested:
            if dim not in view.dim_names:
                raise ValueError(f"{dim!r} is not in view {view.name!r} with dim_names {view.dim_names}")
        if len(set(requested)) != len(requested):
            raise ValueError(f"dimensions {requested} name one dimension twice; name each once")
        return self._order_dims_for(view.dim_names, dims if isinstance(dims, str) else requested)

    def _canonical_pg_key_and_enum_view(
        self, view: _RankViewSpec, ordered_dims: List[str]
    ) -> Tuple[GroupKey, _RankViewSpec, List[str]]:
        """The key a group is stored under and the view that enumerates it: a group over shared dimensions only is
        the base view's."""
        if view.name == _BASE_VIEW_NAME:
            return "-".join(ordered_dims), view, ordered_dims
        if all(d in view.shared_dims for d in ordered_dims):
            base = self._views[_BASE_VIEW_NAME]
            base_dims, base_key = self._order_dims_for(base.dim_names, ordered_dims)
            return base_key, base, base_dims
        return (view.name, tuple(ordered_dims)), view, ordered_dims
