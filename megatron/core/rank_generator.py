"""The arithmetic of a parallel layout: whether it fits the world, and which global ranks form each group.

Ranks are a mixed-radix number over the ``order`` string (e.g. ``tp-cp-ep-dp-pp``), first token fastest-varying.
No process groups here: parallel_state checks the layout and builds its groups from these lists, configs and the
training arguments run the same check, and the training layout report prints the lists.
"""

from math import prod
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
from megatron.core.public_api import public_api

_TOKENS = ("tp", "cp", "ep", "dp", "pp")


@public_api("megatron.core.parallel_state")
class RankGenerator:
    """Enumerates rank groups for a parallel layout.

    ``get_ranks("tp-pp")`` returns every group of ranks that differ only in their tp and pp coordinates, each group
    listed with the first named token varying fastest, groups ordered with the remaining tokens' first one fastest.
    ``rank_offset`` shifts every rank (a layout laid over ranks ``rank_offset ..``); ``gtp_remat`` is Megatron's
    experimental GTP weight-rematerialisation axis, of which only the trivial size 1 is supported.
    """

    def __init__(
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0, gtp_remat: int = 1
    ) -> None:
        if gtp_remat != 1:
            raise ValueError(
                f"not supported yet: GTP weight rematerialisation (gtp_remat={gtp_remat}); use gtp_remat=1"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.sizes_by_token = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        self.order = "-".join(_parse_order(order, self.sizes_by_token))
        self.ordered_size = [self.sizes_by_token[name] for name in self.order.split("-")]
        self.world_size = prod(self.ordered_size)

    def get_mask(self, order: str, token: str) -> List[bool]:
        """One flag per token of ``order``: True for the tokens named in ``token`` (e.g. ``'tp-dp'``)."""
        ordered = order.split("-")
        wanted = token.split("-")
        for name in wanted:
            if name not in ordered:
                raise ValueError(f"unknown parallelism token {name!r} in {token!r}; expected tokens from {ordered}")
        return [name in wanted for name in ordered]

    def get_ranks(self, token) -> List[List[int]]:
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[rank + self.rank_offset for rank in group] for group in groups]


@public_api("megatron.core.parallel_state")
def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: List[int], mask: List[bool]
) -> List[List[int]]:
    """Rank groups of a mixed-radix layout: ranks that differ only in the masked coordinates form a group.

    ``parallel_size`` lists the size of every axis, first (fastest-varying) first, so
    ``rank = sum(coord[i] * prod(parallel_size[:i]))``. Inside a group the masked coordinates count up with the first
    masked axis fastest; groups are ordered the same way by the unmasked coordinates.
    """
    if prod(parallel_size) != world_size:
        raise ValueError(
            f"parallel sizes {parallel_size} multiply to {prod(parallel_size)}, not world size {world_size}"
        )
    if len(mask) != len(parallel_size):
        raise ValueError(f"mask {mask} needs one entry per parallel size {parallel_size}")
    return enumerate_rank_groups(parallel_size, [i for i, masked in enumerate(mask) if masked])


def enumerate_rank_groups(parallel_size: List[int], group_axes: List[int], rank_offset: int = 0) -> List[List[int]]:
    """Rank groups of a mixed-radix layout (``parallel_size`` first axis fastest), ranks starting at ``rank_offset``.

    Ranks that differ only in the coordinates of ``group_axes`` form a group. Inside a group the coordinates count
    up with ``group_axes[0]`` fastest, then ``group_axes[1]``, ...; groups are ordered by the other axes, the first
    of them fastest. The masked-orthogonal groups above list ``group_axes`` in axis order; HyperCommGrid lists
    them in the order its caller names the dimensions.
    """
    # Reversed shape puts the first (fastest) axis last in a C-ordered array.
    ranks = np.arange(rank_offset, rank_offset + prod(parallel_size)).reshape(list(reversed(parallel_size)))
    axis_of = [len(parallel_size) - 1 - i for i in range(len(parallel_size))]
    outer = [axis_of[i] for i in reversed(range(len(parallel_size))) if i not in group_axes]
    inner = [axis_of[i] for i in reversed(group_axes)]
    group_size = prod(parallel_size[i] for i in group_axes)
    return ranks.transpose(outer + inner).reshape(-1, group_size).tolist()


def _parse_order(order: str, sizes_by_token: Dict[str, int]) -> List[str]:
    tokens = order.lower().split("-")
    for token in tokens:
        if token not in _TOKENS:
            raise ValueError(f"unknown token {token!r} in order {order!r}; valid tokens are {', '.join(_TOKENS)}")
    duplicated = sorted({t for t in tokens if tokens.count(t) > 1})
    if duplicated:
        raise ValueError(f"order {order!r} names {duplicated} more than once")
    for token in _TOKENS:
        if token not in tokens:
            if sizes_by_token[token] != 1:
                raise ValueError(
                    f"order {order!r} omits {token!r} but its size is {sizes_by_token[token]}; add it to the order"
                )
            tokens.append(token)
    return tokens


def check_layout(
    world_size: Optional[int],
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    *,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    name: Callable[[str], str] = str,
) -> Optional[Tuple[int, int]]:
    """Check a parallel layout before any group exists; return (data-parallel size, expert data-parallel size), or
    None without a ``world_size``.

    The one layout check: initialize_model_parallel, ModelParallelConfig and the training arguments all call it.
    Every size must be a positive integer; ``world_size`` (skipped when None, e.g. for a config that does not know
    it) must be divisible by tp x pp x cp (the dense layout) and by etp x ep x pp (the expert layout; ``etp``
    defaults to ``tp``). ``name`` turns a field name such as ``tensor_model_parallel_size`` into what the caller's
    user typed (a command-line flag), so each message names the setting, its value and the fix.
    """
    etp = tp if etp is None else etp
    for field, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name(field)} must be a positive integer, got {value!r}")
    if hierarchical_context_parallel_sizes and prod(hierarchical_context_parallel_sizes) != cp:
        raise ValueError(
            f"hierarchical_context_parallel_sizes={list(hierarchical_context_parallel_sizes)} multiply to "
            f"{prod(hierarchical_context_parallel_sizes)}, not context_parallel_size={cp}; give sizes whose product "
            "is the context-parallel size"
        )
    model_parallel, expert_parallel = tp * pp * cp, etp * ep * pp
    if world_size is not None and world_size % model_parallel != 0:
        raise ValueError(
            f"world size ({world_size}) is not divisible by {name('tensor_model_parallel_size')} ({tp}) x "
            f"{name('pipeline_model_parallel_size')} ({pp}) x {name('context_parallel_size')} ({cp}) = "
            f"{model_parallel}; launch a multiple of {model_parallel} processes or change the parallel sizes"
        )
    if world_size is not None and world_size % expert_parallel != 0:
        raise ValueError(
            f"world size ({world_size}) is not divisible by {name('expert_tensor_parallel_size')} ({etp}) x "
            f"{name('expert_model_parallel_size')} ({ep}) x {name('pipeline_model_parallel_size')} ({pp}) = "
            f"{expert_parallel}; launch a multiple of that many processes or change the expert parallel sizes"
        )
    vpp = virtual_pipeline_model_parallel_size
    if vpp is not None:
        if pp < 2:
            raise ValueError(
                f"{name('virtual_pipeline_model_parallel_size')}={vpp} needs "
                f"{name('pipeline_model_parallel_size')} > 1 (got {pp})"
            )
        if vpp < 1:
            raise ValueError(f"{name('virtual_pipeline_model_parallel_size')} must be >= 1, got {vpp}")
    if world_size is None:
        return None
    return world_size // model_parallel, world_size // expert_parallel


def _check_expert_layout_matches_pipeline(
    order: str, pp: int, dp: int, expert_dp: int, dense_pp_groups: List[List[int]], expert_pp_groups: List[List[int]]
) -> None:
    """Attention and MoE layers of one stage must live on the same ranks: both layouts need the same pipelines."""
    if pp > 1 and not order.endswith("pp") and expert_dp != dp:
        raise ValueError(
            f"order {order!r} does not end with 'pp', so the expert data-parallel size ({expert_dp}) must equal the "
            f"data-parallel size ({dp}) when pipeline_model_parallel_size is {pp}; put 'pp' last in the order or "
            "make expert_tensor_parallel_size x expert_model_parallel_size equal "
            "tensor_model_parallel_size x context_parallel_size"
        )
    if dense_pp_groups != expert_pp_groups:
        raise ValueError(
            f"order {order!r} gives the expert layers pipeline groups {expert_pp_groups} but the dense layers "
            f"{dense_pp_groups}; the stages must match, so put 'pp' last in the order or place the tokens before "
            "'pp' so that both layouts have the same product of sizes there"
        )


@public_api("megatron.core.parallel_state")
def default_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """The word embedding lives on the first and last pipeline stages (they share it when tied)."""
    return [pp_ranks[0], pp_ranks[-1]] if len(pp_ranks) > 1 else [pp_ranks[0]]


@public_api("megatron.core.parallel_state")
def default_position_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """Learned position embeddings live on the first pipeline stage only."""
    return [pp_ranks[0]]
