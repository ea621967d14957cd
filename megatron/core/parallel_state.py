"""Process groups and rank layout for tensor, pipeline, data, context and expert parallelism.

Ranks are laid out as a mixed-radix number over the ``order`` string, first token fastest-varying. With the default
``tp-cp-ep-dp-pp`` (and ep=1): ``global_rank = tp_rank + cp_rank*tp + dp_rank*tp*cp + pp_rank*tp*cp*dp``.
Expert groups come from a second layout over (expert-TP, EP, expert-DP, PP) in the same token order, as Megatron does.

This module is a façade: the groups live in one :class:`ProcessGroupCollection` plus the global rank lists of this
rank's groups. Modules should take a ``pg_collection`` and fall back to these globals.
"""

from datetime import timedelta
from math import prod
from typing import Callable, Dict, List, Optional

import numpy as np
import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection

_TOKENS = ("tp", "cp", "ep", "dp", "pp")

# Everything initialize_model_parallel creates; reset by destroy_model_parallel.
_GROUPS: Optional[ProcessGroupCollection] = None
_GLOO_DP_GROUPS: Dict[str, dist.ProcessGroup] = {}
_GROUP_RANKS: Dict[str, List[int]] = {}
_VIRTUAL_PIPELINE_WORLD_SIZE: Optional[int] = None
_VIRTUAL_PIPELINE_RANK: Optional[int] = None
# Test hooks, as in Megatron: when set, these replace what the groups report.
_OVERRIDES: Dict[str, int] = {}


class RankGenerator:
    """Enumerates rank groups for a parallel layout.

    ``get_ranks("tp-pp")`` returns every group of ranks that differ only in their tp and pp coordinates, each group
    listed with the first named token varying fastest, groups ordered with the remaining tokens' first one fastest.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str):
        self.sizes_by_token = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        self.order = _parse_order(order, self.sizes_by_token)
        self.world_size = prod(self.sizes_by_token.values())

    def get_ranks(self, token: str) -> List[List[int]]:
        wanted = token.split("-")
        for name in wanted:
            if name not in self.order:
                raise ValueError(f"unknown parallelism token {name!r} in {token!r}; expected tokens from {self.order}")
        sizes = [self.sizes_by_token[name] for name in self.order]
        # Reversed shape puts the first (fastest) token on the last axis of a C-ordered array.
        ranks = np.arange(self.world_size).reshape(list(reversed(sizes)))
        axis_of = {name: len(self.order) - 1 - i for i, name in enumerate(self.order)}
        outer = [axis_of[name] for name in reversed(self.order) if name not in wanted]
        inner = [axis_of[name] for name in reversed(self.order) if name in wanted]
        group_size = prod(self.sizes_by_token[name] for name in wanted)
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


def default_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """The word embedding lives on the first and last pipeline stages (they share it when tied)."""
    return [pp_ranks[0], pp_ranks[-1]] if len(pp_ranks) > 1 else [pp_ranks[0]]


def default_position_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """Learned position embeddings live on the first pipeline stage only."""
    return [pp_ranks[0]]


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
) -> None:
    """Create every process group for the layout (every rank must call this, with the same arguments).

    ``use_sharp``, ``nccl_communicator_config_path`` and ``pipeline_model_parallel_comm_backend`` are NCCL tuning
    knobs accepted for compatibility; hierarchical context parallelism and several distributed-optimizer instances are
    not supported yet and are rejected when asked for.
    """
    global _GROUPS, _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed: call torch.distributed.init_process_group "
            "(or run under torchrun / megatron.training.initialize) first"
        )
    if hierarchical_context_parallel_sizes:
        raise ValueError("hierarchical_context_parallel_sizes is not supported; leave it unset")
    if num_distributed_optimizer_instances != 1:
        raise ValueError(
            f"num_distributed_optimizer_instances={num_distributed_optimizer_instances} is not supported; use 1"
        )
    tp, pp, cp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    world_size = dist.get_world_size()
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}) = {tp * pp * cp}"
        )
    if world_size % (etp * ep * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size ({etp}) x "
            f"expert_model_parallel_size ({ep}) x pipeline_model_parallel_size ({pp}) = {etp * ep * pp}"
        )
    if virtual_pipeline_model_parallel_size is not None:
        if pp < 2:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} needs "
                f"pipeline_model_parallel_size > 1 (got {pp})"
            )
        if virtual_pipeline_model_parallel_size < 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size must be >= 1, got {virtual_pipeline_model_parallel_size}"
            )
    if _GROUPS is not None:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")

    dp = world_size // (tp * pp * cp)
    expert_dp = world_size // (etp * ep * pp)
    # The dense layout has no ep axis and the expert one no cp axis; between them they validate every token.
    decoder = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=order)
    _check_expert_layout_matches_pipeline(order, pp, dp, expert_dp, decoder.get_ranks("pp"), expert.get_ranks("pp"))

    timeout = timedelta(minutes=distributed_timeout_minutes)
    rank = dist.get_rank()
    use_gloo_dp = create_gloo_process_groups and dist.get_backend() != "gloo"

    def create(name: str, rank_lists: List[List[int]], gloo_twin: bool = False) -> Optional[dist.ProcessGroup]:
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks, timeout=timeout)
            gloo_group = dist.new_group(ranks, timeout=timeout, backend="gloo") if gloo_twin else None
            if rank in ranks:
                mine = group
                _GROUP_RANKS[name] = list(ranks)
                if gloo_twin:
                    _GLOO_DP_GROUPS[name] = gloo_group
        return mine

    groups = ProcessGroupCollection()
    groups.dp = create("dp", decoder.get_ranks("dp"), gloo_twin=use_gloo_dp)
    groups.dp_cp = create("dp_cp", decoder.get_ranks("dp-cp"), gloo_twin=use_gloo_dp)
    groups.cp = create("cp", decoder.get_ranks("cp"))
    groups.mp = create("mp", decoder.get_ranks("tp-pp"))
    groups.tp = create("tp", decoder.get_ranks("tp"))
    groups.pp = create("pp", decoder.get_ranks("pp"))
    groups.tp_cp = create("tp_cp", decoder.get_ranks("tp-cp"))
    groups.tp_dp = create("tp_dp", decoder.get_ranks("tp-dp"))
    groups.tp_dp_cp = create("tp_dp_cp", decoder.get_ranks("tp-cp-dp"))

    embedding_ranks_of = get_embedding_ranks or default_embedding_ranks
    position_ranks_of = get_position_embedding_ranks or default_position_embedding_ranks
    pp_rank_lists = decoder.get_ranks("pp")
    groups.embd = create("embd", [embedding_ranks_of(ranks) for ranks in pp_rank_lists])
    groups.pos_embd = create("pos_embd", [position_ranks_of(ranks) for ranks in pp_rank_lists])
    # Every rank knows its own pipeline's embedding ranks, member or not (as in Megatron), so the
    # is_rank_in_*embedding_group checks answer False on the other stages.
    _GROUP_RANKS["embd"] = embedding_ranks_of(_GROUP_RANKS["pp"])
    _GROUP_RANKS["pos_embd"] = position_ranks_of(_GROUP_RANKS["pp"])

    groups.expt_tp = create("expt_tp", expert.get_ranks("tp"))
    groups.ep = create("ep", expert.get_ranks("ep"))
    groups.tp_ep = create("tp_ep", expert.get_ranks("tp-ep"))
    groups.tp_ep_pp = create("tp_ep_pp", expert.get_ranks("tp-ep-pp"))
    groups.expt_dp = create("expt_dp", expert.get_ranks("dp"), gloo_twin=use_gloo_dp)

    _GROUPS = groups
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_WORLD_SIZE = virtual_pipeline_model_parallel_size
        _VIRTUAL_PIPELINE_RANK = 0


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


def destroy_model_parallel() -> None:
    """Forget every group this module created, so ``initialize_model_parallel`` can run again."""
    global _GROUPS, _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK
    _GROUPS = None
    _GLOO_DP_GROUPS.clear()
    _GROUP_RANKS.clear()
    _OVERRIDES.clear()
    _VIRTUAL_PIPELINE_WORLD_SIZE = None
    _VIRTUAL_PIPELINE_RANK = None


def model_parallel_is_initialized() -> bool:
    return _GROUPS is not None


is_initialized = model_parallel_is_initialized


def is_unitialized() -> bool:
    """Megatron's (misspelt) name: True when the groups have not been created."""
    return _GROUPS is None


def get_process_group_collection() -> ProcessGroupCollection:
    """The groups made by ``initialize_model_parallel``."""
    return _groups()


def _groups() -> ProcessGroupCollection:
    if _GROUPS is None:
        raise RuntimeError("model parallel groups are not initialized; call initialize_model_parallel() first")
    return _GROUPS


def _group(name: str, check_initialized: bool = True) -> Optional[dist.ProcessGroup]:
    if not check_initialized and _GROUPS is None:
        return None
    return getattr(_groups(), name)


def _world_size(name: str) -> int:
    if _GROUPS is None:
        return 1  # Megatron's layers are usable without groups as TP=1 modules.
    return dist.get_world_size(getattr(_GROUPS, name))


def _rank(name: str) -> int:
    if _GROUPS is None:
        return 0
    return dist.get_rank(getattr(_GROUPS, name))


# ---- group accessors -------------------------------------------------------------------------------------------


def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    return _group("pp", check_initialized)


def get_model_parallel_group(check_initialized: bool = True):
    return _group("mp", check_initialized)


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """The data-parallel group, optionally with context parallelism folded in.

    ``partial_data_parallel`` asks for the distributed optimizer's intra-instance group; with the one instance
    supported here that is the whole data x context group, as in Megatron.
    """
    if partial_data_parallel and not with_context_parallel:
        raise ValueError(
            "partial_data_parallel=True needs with_context_parallel=True: the optimizer's partial data-parallel "
            "group always includes context parallelism"
        )
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """A gloo twin of the data-parallel group (the group itself when the default backend is already gloo)."""
    name = "dp_cp" if with_context_parallel else "dp"
    return _GLOO_DP_GROUPS.get(name) or get_data_parallel_group(with_context_parallel, partial_data_parallel)


def get_context_parallel_group(check_initialized: bool = True):
    return _group("cp", check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True) -> List[int]:
    return list(_GROUP_RANKS["cp"]) if _GROUPS is not None else [0]


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    return _group("tp_cp", check_initialized)


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False):
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_embedding_group(check_initialized: bool = True):
    return _group("embd", check_initialized)


def get_position_embedding_group(check_initialized: bool = True):
    return _group("pos_embd", check_initialized)


def get_expert_model_parallel_group(check_initialized: bool = True):
    return _group("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    return _group("expt_tp", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    return _group("tp_ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True):
    return _group("tp_ep_pp", check_initialized)


def get_expert_data_parallel_group(check_initialized: bool = True, partial_expert_data_parallel: bool = False):
    return _group("expt_dp", check_initialized)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False):
    return _GLOO_DP_GROUPS.get("expt_dp") or get_expert_data_parallel_group()


# ---- sizes and ranks -------------------------------------------------------------------------------------------


def get_tensor_model_parallel_world_size() -> int:
    return _OVERRIDES.get("tp_size") or _world_size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _OVERRIDES["tp_rank"] if "tp_rank" in _OVERRIDES else _rank("tp")


def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("tp_size", world_size)


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("tp_rank", rank)


def get_pipeline_model_parallel_world_size() -> int:
    return _OVERRIDES.get("pp_size") or _world_size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _OVERRIDES["pp_rank"] if "pp_rank" in _OVERRIDES else _rank("pp")


def set_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("pp_size", world_size)


def set_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("pp_rank", rank)


def _set_override(key: str, value: Optional[int]) -> None:
    if value is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = value


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return _world_size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return _rank("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_world_size() -> int:
    return _world_size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _world_size("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    return _rank("tp_cp")


def get_tensor_and_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _world_size("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_expert_model_parallel_world_size() -> int:
    return _world_size("ep")


def get_expert_model_parallel_rank() -> int:
    return _rank("ep")


def get_expert_tensor_parallel_world_size() -> int:
    return _world_size("expt_tp")


def get_expert_tensor_parallel_rank() -> int:
    return _rank("expt_tp")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _world_size("tp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank("tp_ep")


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    return _world_size("expt_dp")


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    return _rank("expt_dp")


# ---- source ranks and pipeline neighbours ----------------------------------------------------------------------


def _group_ranks(name: str) -> List[int]:
    _groups()
    return _GROUP_RANKS[name]


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's tensor-parallel group (the source of TP broadcasts)."""
    return _group_ranks("tp")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _group_ranks("dp_cp" if with_context_parallel else "dp")[0]


def get_model_parallel_src_rank() -> int:
    return _group_ranks("mp")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return _group_ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _group_ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _group_ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _group_ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_embedding_group_ranks() -> List[int]:
    return list(_group_ranks("embd"))


# ---- pipeline stages and virtual pipeline ----------------------------------------------------------------------


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _VIRTUAL_PIPELINE_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    global _VIRTUAL_PIPELINE_WORLD_SIZE
    _VIRTUAL_PIPELINE_WORLD_SIZE = world_size


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _VIRTUAL_PIPELINE_RANK


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    global _VIRTUAL_PIPELINE_RANK
    _VIRTUAL_PIPELINE_RANK = rank


def is_pipeline_first_stage(ignore_virtual: bool = False, vp_stage: Optional[int] = None) -> bool:
    """True on the first pipeline stage (and, unless ``ignore_virtual``, for its first virtual chunk)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_WORLD_SIZE is not None:
        chunk = _VIRTUAL_PIPELINE_RANK if vp_stage is None else vp_stage
        if chunk != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False, vp_stage: Optional[int] = None) -> bool:
    """True on the last pipeline stage (and, unless ``ignore_virtual``, for its last virtual chunk)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_WORLD_SIZE is not None:
        chunk = _VIRTUAL_PIPELINE_RANK if vp_stage is None else vp_stage
        if chunk != _VIRTUAL_PIPELINE_WORLD_SIZE - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = False, vp_stage: Optional[int] = None) -> bool:
    """True where this rank holds a copy of the word embedding that must be kept in sync."""
    rank = dist.get_rank()
    ranks = _group_ranks("embd")
    if ignore_virtual:
        return rank in ranks
    if rank == ranks[0]:
        return is_pipeline_first_stage(vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(vp_stage=vp_stage)
    return rank in ranks


def is_rank_in_position_embedding_group() -> bool:
    return dist.get_rank() in _group_ranks("pos_embd")
