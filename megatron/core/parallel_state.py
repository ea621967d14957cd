"""Process groups and rank layout for tensor, pipeline, data, context and expert parallelism.

Ranks are laid out as a mixed-radix number over the ``order`` string, first token fastest-varying. With the default
``tp-cp-ep-dp-pp`` (and ep=1): ``global_rank = tp_rank + cp_rank*tp + dp_rank*tp*cp + pp_rank*tp*cp*dp``.
Expert groups come from a second layout over (expert-TP, EP, expert-DP, PP) in the same token order, as Megatron does.

This module is a façade: the groups live in one :class:`ProcessGroupCollection` plus the global rank lists of this
rank's groups. Modules should take a ``pg_collection`` and fall back to these globals. The layout arithmetic
(:class:`RankGenerator`, :func:`check_layout`) is in :mod:`megatron.core.rank_generator` and the group-making helpers
in :mod:`megatron.core.group_creation`.
"""

import logging
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

# Group making and rank arithmetic live in their own modules; Megatron's names stay importable from here.
from megatron.core.public_api import public_api
from megatron.core.group_creation import (  # noqa: F401
    create_group,
    create_hierarchical_groups,
    destroy_created_groups,
    get_nccl_options,
    overwrite_nccl_comm_cfgs,
    read_nccl_comm_cfgs,
    update_pg_timeout,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rank_generator import (  # noqa: F401
    RankGenerator,
    _check_expert_layout_matches_pipeline,
    check_layout,
    default_embedding_ranks,
    default_position_embedding_ranks,
    generate_masked_orthogonal_rank_groups,
)
from megatron.core.utils import GlobalMemoryBuffer, get_pg_rank

# Everything initialize_model_parallel creates; reset by destroy_model_parallel. The collection itself is kept in
# ProcessGroupCollection._default, where use_mpu_process_groups reads it.
_GLOO_DP_GROUPS: Dict[str, dist.ProcessGroup] = {}
# Groups that are not fields of ProcessGroupCollection (tensor x data without context parallelism).
_OTHER_GROUPS: Dict[str, dist.ProcessGroup] = {}
_GROUP_RANKS: Dict[str, List[int]] = {}
_VIRTUAL_PIPELINE_WORLD_SIZE: Optional[int] = None
_VIRTUAL_PIPELINE_RANK: Optional[int] = None
# Test hooks, as in Megatron: when set, these replace what the groups report.
_OVERRIDES: Dict[str, int] = {}
_GLOBAL_MEMORY_BUFFER: Optional[GlobalMemoryBuffer] = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[List[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    rank_offset: int = 0,
    local_world_size: Optional[int] = None,
) -> None:
    """Create every process group for the layout (every rank must call this, with the same arguments).

    ``nccl_communicator_config_path`` (a YAML file of per-group NCCL options, see :func:`get_nccl_options`) is
    applied when the backend is NCCL. ``use_sharp``, ``sharp_enabled_group``, ``high_priority_stream_groups`` and
    ``pipeline_model_parallel_comm_backend`` are NCCL tuning knobs, accepted and ignored (they do not change what the
    groups compute). ``hierarchical_context_parallel_sizes`` (product = ``context_parallel_size``) builds the
    per-level CP groups that ``cp_comm_type='a2a+p2p'`` uses. Hybrid context parallelism, several
    distributed-optimizer instances, GTP weight rematerialisation and layouts over part of the world (``rank_offset``,
    ``local_world_size``) are not supported
    yet and are refused with a ValueError before any group is created.
    """
    global _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed: call torch.distributed.init_process_group "
            "(or run under torchrun / megatron.training.initialize) first"
        )
    _refuse_unsupported_layouts(
        hybrid_context_parallel=hybrid_context_parallel,
        gtp_remat_size=gtp_remat_size,
        expert_gtp_remat_size=expert_gtp_remat_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        rank_offset=rank_offset,
        local_world_size=local_world_size,
    )
    tp, pp, cp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    world_size = dist.get_world_size()
    dp, expert_dp = check_layout(
        world_size,
        tp,
        pp,
        cp,
        ep,
        etp,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )
    if ProcessGroupCollection._default is not None:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")

    # The dense layout has no ep axis and the expert one no cp axis; between them they validate every token.
    decoder = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=order)
    _check_expert_layout_matches_pipeline(order, pp, dp, expert_dp, decoder.get_ranks("pp"), expert.get_ranks("pp"))

    timeout = timedelta(minutes=distributed_timeout_minutes)
    create = _group_creator(timeout, read_nccl_comm_cfgs(nccl_communicator_config_path))
    use_gloo_dp = create_gloo_process_groups and dist.get_backend() != "gloo"
    # Group creation is collective: every rank creates every group, in this order.
    groups = ProcessGroupCollection()
    _create_dense_groups(groups, create, decoder, use_gloo_dp)
    _create_embedding_groups(groups, create, decoder, get_embedding_ranks, get_position_embedding_ranks)
    _create_expert_groups(groups, create, expert, use_gloo_dp)
    _set_groups_of_features_off(groups, create, world_size)
    if hierarchical_context_parallel_sizes:
        groups.hcp = _create_hierarchical_cp_groups(decoder, hierarchical_context_parallel_sizes, timeout)

    ProcessGroupCollection._default = groups
    _set_global_memory_buffer()
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_WORLD_SIZE = virtual_pipeline_model_parallel_size
        _VIRTUAL_PIPELINE_RANK = 0


def _group_creator(timeout: timedelta, nccl_comm_cfgs: dict) -> Callable[..., Optional[dist.ProcessGroup]]:
    """``create(name, rank_lists, gloo_twin=False)``: create one group per rank list and return this rank's (None
    when it is in none), recording its ranks (and its gloo twin) under ``name``."""
    rank = dist.get_rank()

    def create(name: str, rank_lists: List[List[int]], gloo_twin: bool = False) -> Optional[dist.ProcessGroup]:
        mine = None
        options = get_nccl_options(name, nccl_comm_cfgs) if dist.get_backend() == "nccl" else None
        for ranks in rank_lists:
            group = create_group(ranks, timeout=timeout, pg_options=options, group_desc=name.upper())
            gloo_group = None
            if gloo_twin:
                gloo_group = create_group(ranks, timeout=timeout, backend="gloo", group_desc=f"{name.upper()}_GLOO")
            if rank in ranks:
                mine = group
                _GROUP_RANKS[name] = list(ranks)
                if gloo_twin:
                    _GLOO_DP_GROUPS[name] = gloo_group
        return mine

    return create


def _create_dense_groups(groups: ProcessGroupCollection, create, decoder: RankGenerator, use_gloo_dp: bool) -> None:
    groups.dp = create("dp", decoder.get_ranks("dp"), gloo_twin=use_gloo_dp)
    groups.dp_cp = create("dp_cp", decoder.get_ranks("dp-cp"), gloo_twin=use_gloo_dp)
    groups.cp = create("cp", decoder.get_ranks("cp"))
    groups.mp = create("mp", decoder.get_ranks("tp-pp"))
    groups.tp = create("tp", decoder.get_ranks("tp"))
    groups.pp = create("pp", decoder.get_ranks("pp"))
    groups.tp_cp = create("tp_cp", decoder.get_ranks("tp-cp"))
    _OTHER_GROUPS["tp_dp"] = create("tp_dp", decoder.get_ranks("tp-dp"))
    groups.tp_dp_cp = create("tp_dp_cp", decoder.get_ranks("tp-cp-dp"))


def _create_embedding_groups(
    groups: ProcessGroupCollection, create, decoder: RankGenerator, get_embedding_ranks, get_position_embedding_ranks
) -> None:
    embedding_ranks_of = get_embedding_ranks or default_embedding_ranks
    position_ranks_of = get_position_embedding_ranks or default_position_embedding_ranks
    pp_rank_lists = decoder.get_ranks("pp")
    groups.embd = create("embd", [embedding_ranks_of(ranks) for ranks in pp_rank_lists])
    groups.pos_embd = create("pos_embd", [position_ranks_of(ranks) for ranks in pp_rank_lists])
    # Every rank knows its own pipeline's embedding ranks, member or not (as in Megatron), so the
    # is_rank_in_*embedding_group checks answer False on the other stages.
    _GROUP_RANKS["embd"] = embedding_ranks_of(_GROUP_RANKS["pp"])
    _GROUP_RANKS["pos_embd"] = position_ranks_of(_GROUP_RANKS["pp"])


def _create_expert_groups(groups: ProcessGroupCollection, create, expert: RankGenerator, use_gloo_dp: bool) -> None:
    groups.expt_tp = create("expt_tp", expert.get_ranks("tp"))
    groups.ep = create("ep", expert.get_ranks("ep"))
    groups.tp_ep = create("tp_ep", expert.get_ranks("tp-ep"))
    groups.tp_ep_pp = create("tp_ep_pp", expert.get_ranks("tp-ep-pp"))
    groups.expt_dp = create("expt_dp", expert.get_ranks("dp"), gloo_twin=use_gloo_dp)


def _set_groups_of_features_off(groups: ProcessGroupCollection, create, world_size: int) -> None:
    """The groups of features this layout does not use, as Megatron has them when those features are off."""
    # One distributed-optimizer instance: the partial data-parallel groups are the whole ones, the instance is the
    # whole world, and there is no group across instances.
    groups.intra_dp_cp = groups.dp_cp
    groups.intra_expt_dp = groups.expt_dp
    groups.intra_dist_opt = create("intra_dist_opt", [list(range(world_size))])
    groups.inter_dist_opt = None
    # GTP weight rematerialisation is off (size 1): its groups do not exist and the "with GTP" data-parallel
    # groups are the plain ones. The all-gather and hierarchical-CP groups exist only when asked for.
    groups.tp_ep_pp_with_egtp_remat = groups.tp_ep_pp
    groups.dp_cp_gtp_remat = groups.dp_cp
    groups.expt_dp_gtp_remat = groups.expt_dp
    groups.gtp_remat = None
    groups.expt_gtp_remat = None
    groups.hcp = None
    groups.dp_cp_ag = None
    groups.expt_dp_ag = None


def _create_hierarchical_cp_groups(
    decoder: RankGenerator, sizes: List[int], timeout: timedelta
) -> Optional[List[dist.ProcessGroup]]:
    """One set of per-level groups inside every CP group; this rank's levels."""
    rank, mine = dist.get_rank(), None
    for cp_ranks in decoder.get_ranks("cp"):
        levels, _ = create_hierarchical_groups(rank, cp_ranks, sizes, timeout=timeout, group_desc="CONTEXT_PARALLEL")
        if rank in cp_ranks:
            mine = levels
    return mine


def _refuse_unsupported_layouts(**requested) -> None:
    """Raise before any collective for layout options whose feature is not built yet."""
    defaults = {
        "hybrid_context_parallel": False,
        "gtp_remat_size": 1,
        "expert_gtp_remat_size": 1,
        "num_distributed_optimizer_instances": 1,
        "rank_offset": 0,
        "local_world_size": None,
    }
    features = {
        "hybrid_context_parallel": "hybrid context parallelism",
        "gtp_remat_size": "GTP weight rematerialisation",
        "expert_gtp_remat_size": "expert GTP weight rematerialisation",
        "num_distributed_optimizer_instances": "several distributed-optimizer instances",
        "rank_offset": "a layout over part of the world",
        "local_world_size": "a layout over part of the world",
    }
    for name, value in requested.items():
        if name == "local_world_size" and value == dist.get_world_size():
            continue
        if value != defaults[name]:
            raise ValueError(f"not supported yet: {features[name]} ({name}={value!r}); leave it at {defaults[name]!r}")


def create_all_gather_groups(for_expert_parallelism=False, timeout=None, nccl_comm_cfgs=None):
    """Create separate communicators, with the same members as the (expert) data x context groups, for parameter
    all-gathers, so those can overlap with gradient reduce-scatters on the original groups.

    Collective over all ranks; the result is this rank's group, also available as ``dp_cp_ag`` / ``expt_dp_ag`` in
    the process-group collection.
    """
    groups = _groups()
    name = "expt_dp_ag" if for_expert_parallelism else "dp_cp_ag"
    source = "expt_dp" if for_expert_parallelism else "dp_cp"
    options = None
    if nccl_comm_cfgs and dist.get_backend() == "nccl":
        options = get_nccl_options(name, nccl_comm_cfgs)
    world_size = dist.get_world_size()
    members = list(_GROUP_RANKS[source])
    # Every rank learns every group's members, since every rank must take part in creating each group.
    everyone = [None] * world_size
    dist.all_gather_object(everyone, members)
    mine = None
    for ranks in sorted({tuple(r) for r in everyone}):
        group = create_group(list(ranks), timeout=timeout, pg_options=options, group_desc=name.upper())
        if dist.get_rank() in ranks:
            mine = group
    setattr(groups, name, mine)
    return mine


def destroy_model_parallel() -> None:
    """Forget every group this module created, so ``initialize_model_parallel`` can run again."""
    global _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK
    ProcessGroupCollection._default = None
    _GLOO_DP_GROUPS.clear()
    _OTHER_GROUPS.clear()
    _GROUP_RANKS.clear()
    _OVERRIDES.clear()
    destroy_global_memory_buffer()
    destroy_created_groups()
    _VIRTUAL_PIPELINE_WORLD_SIZE = None
    _VIRTUAL_PIPELINE_RANK = None


def model_parallel_is_initialized() -> bool:
    return ProcessGroupCollection._default is not None


is_initialized = model_parallel_is_initialized


def is_unitialized() -> bool:
    """Megatron's (misspelt) name: True when the groups have not been created."""
    return ProcessGroupCollection._default is None


def get_process_group_collection() -> ProcessGroupCollection:
    """The groups made by ``initialize_model_parallel``."""
    return _groups()


def _groups() -> ProcessGroupCollection:
    if ProcessGroupCollection._default is None:
        raise RuntimeError("model parallel groups are not initialized; call initialize_model_parallel() first")
    return ProcessGroupCollection._default


# Groups that exist only for features this layout did not ask for; asking for one with check_initialized is an
# error (the other groups are None only on ranks outside every such group, e.g. embd on middle pipeline stages).
_ONLY_WHEN_ASKED_FOR = {"hcp", "inter_dist_opt", "gtp_remat", "expt_gtp_remat", "dp_cp_ag", "expt_dp_ag"}


def _group(name: str, check_initialized: bool = True) -> Optional[dist.ProcessGroup]:
    """This rank's group ``name``; with ``check_initialized`` a group that does not exist is an error."""
    if ProcessGroupCollection._default is None:
        if check_initialized:
            _groups()
        return None
    group = _OTHER_GROUPS[name] if name in _OTHER_GROUPS else getattr(ProcessGroupCollection._default, name)
    if group is None and check_initialized and name in _ONLY_WHEN_ASKED_FOR:
        raise RuntimeError(f"process group {name!r} was not created by initialize_model_parallel for this layout")
    return group


def _world_size(name: str) -> int:
    if ProcessGroupCollection._default is None:
        return 1  # Megatron's layers are usable without groups as TP=1 modules.
    return dist.get_world_size(_group(name))


def _rank(name: str) -> int:
    if ProcessGroupCollection._default is None:
        return 0
    return dist.get_rank(_group(name))


# ---- group accessors -------------------------------------------------------------------------------------------


def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    return _group("pp", check_initialized)


def get_model_parallel_group(check_initialized: bool = True):
    return _group("mp", check_initialized)


def get_data_parallel_group(with_context_parallel=False, with_gtp_remat=True, partial_data_parallel=False):
    """The data-parallel group, optionally with context parallelism folded in.

    ``partial_data_parallel`` asks for the distributed optimizer's intra-instance group; with the one instance
    supported here that is the whole data x context group, as in Megatron. ``with_gtp_remat`` selects the group
    with GTP weight rematerialisation folded in, which is the same group while that feature is off (size 1).
    """
    if partial_data_parallel and not with_context_parallel:
        raise ValueError(
            "partial_data_parallel=True needs with_context_parallel=True: the optimizer's partial data-parallel "
            "group always includes context parallelism"
        )
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """A gloo twin of the data-parallel group (the group itself when the default backend is already gloo)."""
    name = "dp_cp" if with_context_parallel else "dp"
    return _GLOO_DP_GROUPS.get(name) or get_data_parallel_group(
        with_context_parallel, partial_data_parallel=partial_data_parallel
    )


def get_context_parallel_group(check_initialized: bool = True):
    return _group("cp", check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True) -> List[int]:
    return list(_GROUP_RANKS["cp"]) if ProcessGroupCollection._default is not None else [0]


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    return _group("tp_cp", check_initialized)


def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """The per-level context-parallel groups of hierarchical CP (``[a2a group, p2p group]`` for ``a2a+p2p``), built
    when ``hierarchical_context_parallel_sizes`` was given (otherwise None, or an error with check_initialized)."""
    return _group("hcp", check_initialized)


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The group FP8 amax values are reduced over: tensor (x context) ranks, plus data ranks unless
    ``tp_only_amax_red``."""
    if tp_only_amax_red:
        return _group("tp_cp" if with_context_parallel else "tp")
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    """All ranks of this rank's distributed-optimizer instance (the whole world with one instance)."""
    return _group("intra_dist_opt", check_initialized)


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """The group across distributed-optimizer instances; it exists only with several instances."""
    return _group("inter_dist_opt", check_initialized)


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


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True, with_egtp_remat=False):
    """Expert tensor x expert x pipeline ranks; ``with_egtp_remat`` adds expert GTP rematerialisation, the same
    group while that feature is off (size 1)."""
    return _group("tp_ep_pp_with_egtp_remat" if with_egtp_remat else "tp_ep_pp", check_initialized)


def get_expert_data_parallel_group(check_initialized=True, with_gtp_remat=True, partial_expert_data_parallel=False):
    """The expert data-parallel group (the intra-instance one is the same group with one optimizer instance)."""
    return _group("intra_expt_dp" if partial_expert_data_parallel else "expt_dp", check_initialized)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    return _GLOO_DP_GROUPS.get("expt_dp") or get_expert_data_parallel_group(
        partial_expert_data_parallel=partial_expert_data_parallel
    )


# ---- the group-or-default resolver -----------------------------------------------------------------------------


@public_api("megatron.core.utils")
def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
    """``tp_group`` when given, else this rank's (expert) tensor-parallel group: the one "group or default" rule.

    With ``check_initialized=False`` the answer is None when no model-parallel groups exist; the tensor-parallel
    layers treat that None as a one-rank group, so they also work as plain single-process modules.
    """
    if tp_group is not None:
        return tp_group
    if is_expert:
        return get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return get_tensor_model_parallel_group(check_initialized=check_initialized)


def tp_group_or_default(pg_collection: Optional[ProcessGroupCollection]) -> dist.ProcessGroup:
    """The tensor-parallel group of ``pg_collection``, or the global one when it is None or has no tp group."""
    return get_tensor_model_parallel_group_if_none(getattr(pg_collection, "tp", None))


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


def get_data_parallel_world_size(with_context_parallel=False, with_gtp_remat=True, partial_data_parallel=False):
    return _world_size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel=False, with_gtp_remat=True, partial_data_parallel=False):
    if "dp_rank" in _OVERRIDES:
        return _OVERRIDES["dp_rank"]
    return _rank("dp_cp" if with_context_parallel else "dp")


def set_data_parallel_rank(rank):
    """Test hook: make get_data_parallel_rank report ``rank`` (None restores the group's answer)."""
    _set_override("dp_rank", rank)


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
    return _OVERRIDES.get("ep_size") or _world_size("ep")


def get_expert_model_parallel_rank() -> int:
    return _OVERRIDES["ep_rank"] if "ep_rank" in _OVERRIDES else _rank("ep")


def set_expert_model_parallel_world_size(world_size):
    _set_override("ep_size", world_size)


def set_expert_model_parallel_rank(rank):
    _set_override("ep_rank", rank)


def get_expert_tensor_parallel_world_size() -> int:
    return _OVERRIDES.get("etp_size") or _world_size("expt_tp")


def get_expert_tensor_parallel_rank() -> int:
    return _OVERRIDES["etp_rank"] if "etp_rank" in _OVERRIDES else _rank("expt_tp")


def set_expert_tensor_parallel_world_size(world_size):
    _set_override("etp_size", world_size)


def set_expert_tensor_parallel_rank(rank):
    _set_override("etp_rank", rank)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _world_size("tp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank("tp_ep")


def get_expert_data_parallel_world_size(with_gtp_remat=True, partial_expert_data_parallel=False):
    return _world_size("intra_expt_dp" if partial_expert_data_parallel else "expt_dp")


def get_expert_data_parallel_rank(with_gtp_remat=True, partial_expert_data_parallel=False):
    return _rank("intra_expt_dp" if partial_expert_data_parallel else "expt_dp")


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


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of EP rank 0 in this rank's expert-parallel group."""
    return _group_ranks("ep")[0]


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


def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None) -> bool:
    """True on the first pipeline stage; with ``ignore_virtual=False`` also only for its first virtual chunk
    (``vp_stage``, defaulting to the current virtual rank)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_WORLD_SIZE is not None:
        chunk = _VIRTUAL_PIPELINE_RANK if vp_stage is None else vp_stage
        if chunk != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None) -> bool:
    """True on the last pipeline stage; with ``ignore_virtual=False`` also only for its last virtual chunk."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_WORLD_SIZE is not None:
        chunk = _VIRTUAL_PIPELINE_RANK if vp_stage is None else vp_stage
        if chunk != _VIRTUAL_PIPELINE_WORLD_SIZE - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None) -> bool:
    """True where this rank holds a copy of the word embedding that must be kept in sync."""
    rank = dist.get_rank()
    ranks = _group_ranks("embd")
    if ignore_virtual:
        return rank in ranks
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return rank in ranks


def is_rank_in_position_embedding_group() -> bool:
    return dist.get_rank() in _group_ranks("pos_embd")


# ---- global memory buffer and diagnostics ----------------------------------------------------------------------


def _set_global_memory_buffer() -> None:
    global _GLOBAL_MEMORY_BUFFER
    if _GLOBAL_MEMORY_BUFFER is not None:
        raise RuntimeError("global memory buffer is already initialized")
    _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The scratch buffer that initialize_model_parallel creates (reused for all-gather outputs and the like)."""
    if _GLOBAL_MEMORY_BUFFER is None:
        raise RuntimeError("global memory buffer is not initialized; call initialize_model_parallel() first")
    return _GLOBAL_MEMORY_BUFFER


def destroy_global_memory_buffer() -> None:
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


def get_all_ranks() -> str:
    """This rank's tensor, data, context, pipeline and expert-parallel ranks as ``"tp_dp_cp_pp_ep"``."""
    ranks = [
        get_tensor_model_parallel_rank(),
        get_data_parallel_rank(),
        get_context_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_expert_model_parallel_rank(),
    ]
    return "_".join(str(rank or 0) for rank in ranks)


@public_api("megatron.core.utils")
def log_on_each_pipeline_stage(
    logger: logging.Logger,
    *args: Any,
    tp_group: Optional[dist.ProcessGroup] = None,
    dp_cp_group: Optional[dist.ProcessGroup] = None,
    **kwargs: Any,
):
    """``logger.log(*args, **kwargs)`` on one rank per pipeline stage: tensor-parallel rank 0 of data x context rank 0.

    The groups default to this module's.
    """
    if dist.is_initialized() and model_parallel_is_initialized():
        tp_group = tp_group or get_tensor_model_parallel_group()
        dp_cp_group = dp_cp_group or get_data_parallel_group(with_context_parallel=True)
    if get_pg_rank(tp_group) == 0 and get_pg_rank(dp_cp_group) == 0:
        logger.log(*args, **kwargs)
