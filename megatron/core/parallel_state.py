"""Process groups and rank layout for tensor, pipeline, data, context and expert parallelism.

Ranks are laid out as a mixed-radix number over the ``order`` string, first token fastest-varying. With the default
``tp-cp-ep-dp-pp`` (and ep=1): ``global_rank = tp_rank + cp_rank*tp + dp_rank*tp*cp + pp_rank*tp*cp*dp``.
Expert groups come from a second layout over (expert-TP, EP, expert-DP, PP) in the same token order, as Megatron does.

This module is a façade: the groups live in one :class:`ProcessGroupCollection` plus the global rank lists of this
rank's groups. Modules should take a ``pg_collection`` and fall back to these globals.
"""

import logging
from datetime import timedelta
from math import prod
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import GlobalMemoryBuffer, get_pg_rank, synchronize_device

logger = logging.getLogger(__name__)

_TOKENS = ("tp", "cp", "ep", "dp", "pp")

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
# The groups this rank belongs to, for update_pg_timeout; None stands for the default (world) group.
_global_process_group_list: Optional[List[Optional[dist.ProcessGroup]]] = None


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
    # Reversed shape puts the first (fastest) axis last in a C-ordered array.
    ranks = np.arange(world_size).reshape(list(reversed(parallel_size)))
    axis_of = [len(parallel_size) - 1 - i for i in range(len(parallel_size))]
    outer = [axis_of[i] for i in reversed(range(len(mask))) if not mask[i]]
    inner = [axis_of[i] for i in reversed(range(len(mask))) if mask[i]]
    group_size = prod(size for size, masked in zip(parallel_size, mask) if masked)
    return ranks.transpose(outer + inner).reshape(-1, group_size).tolist()


def create_group(
    ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False, group_desc=None
):
    """``torch.distributed.new_group`` that also records the group (when this rank is in it) for update_pg_timeout.

    Every rank must call it for every group, member or not, unless ``use_local_synchronization`` is set.
    """
    global _global_process_group_list
    group = dist.new_group(
        ranks=ranks,
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
    )
    if _global_process_group_list is None:
        _global_process_group_list = [None]
    if ranks is None or dist.get_rank() in ranks:
        _global_process_group_list.append(group)
    return group


def update_pg_timeout(timeout: timedelta, pg: Optional[dist.ProcessGroup] = None):
    """Change the collective timeout of ``pg``, or of every group this rank created through create_group (and the
    default group) when ``pg`` is None.

    All members synchronise first, so no rank changes the timeout under a collective another rank is still in.
    """
    dist.barrier(group=pg)
    synchronize_device()
    targets = [pg] if pg is not None else (_global_process_group_list or [None])
    for group in targets:
        try:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        except Exception:
            logger.error("failed to set timeout %s on process group %s", timeout, group)
            raise


def create_hierarchical_groups(
    rank,
    ranks,
    hierarchical_group_sizes,
    create_gloo_process_groups=False,
    pg_options=None,
    timeout=None,
    group_desc=None,
):
    """Split ``ranks`` into nested levels of sub-groups; return this rank's group at each level (and gloo twins).

    With ``hierarchical_group_sizes = [a, b, c]`` (product = len(ranks)) level 0 groups ``a`` consecutive ranks,
    level 1 groups ``b`` ranks ``a`` apart, level 2 groups ``c`` ranks ``a*b`` apart: ``ranks`` read as a
    mixed-radix number with the level-0 digit fastest. ``pg_options`` may be one value or one per level.
    """
    if prod(hierarchical_group_sizes) != len(ranks):
        raise ValueError(
            f"hierarchical_group_sizes {hierarchical_group_sizes} multiply to {prod(hierarchical_group_sizes)}, "
            f"not the {len(ranks)} ranks given"
        )
    levels = len(hierarchical_group_sizes)
    options = pg_options if isinstance(pg_options, list) else [pg_options] * levels
    groups, gloo_groups = [], []
    for level in range(levels):
        mask = [i == level for i in range(levels)]
        for positions in generate_masked_orthogonal_rank_groups(len(ranks), list(hierarchical_group_sizes), mask):
            sub_ranks = [ranks[p] for p in positions]
            group = create_group(
                sub_ranks, timeout=timeout, pg_options=options[level], group_desc=f"HIERARCHICAL_{group_desc}_L{level}"
            )
            gloo_group = None
            if create_gloo_process_groups:
                gloo_group = create_group(
                    sub_ranks, timeout=timeout, backend="gloo", group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}"
                )
            if rank in sub_ranks:
                groups.append(group)
                gloo_groups.append(gloo_group)
    return groups, gloo_groups


def get_nccl_options(pg_name, nccl_comm_cfgs):
    """NCCL options for group ``pg_name`` from a parsed ``nccl_communicator_config_path`` file (None if not listed).

    Recognised keys: ``is_high_priority_stream``, ``cga_cluster_size``, ``max_ctas``, ``min_ctas``, ``net_name``
    (``IB`` or ``socket``); NCCL's defaults apply to the rest.
    """
    if pg_name not in nccl_comm_cfgs:
        return None
    cfg = nccl_comm_cfgs[pg_name]
    net_name = cfg.get("net_name")
    if net_name is not None and net_name.lower() not in ("ib", "socket"):
        raise ValueError(f"net_name ({net_name}) for process group {pg_name!r} is not supported; use 'IB' or 'socket'")
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise RuntimeError(
            f"NCCL options were given for process group {pg_name!r} but this PyTorch build has no NCCL backend"
        )
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=cfg.get("is_high_priority_stream", False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in cfg:
            setattr(options.config, key, cfg[key])
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set ``nccl_comm_cfgs[pg_name][key] = value`` for ``key_value_pair = (key, value)``, adding the group if new."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


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
    rank = dist.get_rank()
    use_gloo_dp = create_gloo_process_groups and dist.get_backend() != "gloo"
    nccl_comm_cfgs = _read_nccl_comm_cfgs(nccl_communicator_config_path)

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

    groups = ProcessGroupCollection()
    groups.dp = create("dp", decoder.get_ranks("dp"), gloo_twin=use_gloo_dp)
    groups.dp_cp = create("dp_cp", decoder.get_ranks("dp-cp"), gloo_twin=use_gloo_dp)
    groups.cp = create("cp", decoder.get_ranks("cp"))
    groups.mp = create("mp", decoder.get_ranks("tp-pp"))
    groups.tp = create("tp", decoder.get_ranks("tp"))
    groups.pp = create("pp", decoder.get_ranks("pp"))
    groups.tp_cp = create("tp_cp", decoder.get_ranks("tp-cp"))
    _OTHER_GROUPS["tp_dp"] = create("tp_dp", decoder.get_ranks("tp-dp"))
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
    if hierarchical_context_parallel_sizes:
        # One set of per-level groups inside every CP group (group creation is collective: all ranks, same order).
        for cp_ranks in decoder.get_ranks("cp"):
            levels, _ = create_hierarchical_groups(
                rank, cp_ranks, hierarchical_context_parallel_sizes, timeout=timeout, group_desc="CONTEXT_PARALLEL"
            )
            if rank in cp_ranks:
                groups.hcp = levels
    groups.dp_cp_ag = None
    groups.expt_dp_ag = None

    ProcessGroupCollection._default = groups
    _set_global_memory_buffer()
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_WORLD_SIZE = virtual_pipeline_model_parallel_size
        _VIRTUAL_PIPELINE_RANK = 0


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


def _read_nccl_comm_cfgs(path: Optional[str]) -> dict:
    """Per-group NCCL options from Megatron's YAML file (``{group name: {option: value}}``)."""
    if path is None:
        return {}
    import yaml

    try:
        with open(path) as f:
            cfgs = yaml.safe_load(f) or {}
    except OSError as error:
        raise ValueError(f"nccl_communicator_config_path={path!r} cannot be read: {error}") from error
    if not isinstance(cfgs, dict) or not all(isinstance(v, dict) for v in cfgs.values()):
        raise ValueError(
            f"nccl_communicator_config_path={path!r} must map process group names to option dicts, got {cfgs!r}"
        )
    return cfgs


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
    global _VIRTUAL_PIPELINE_WORLD_SIZE, _VIRTUAL_PIPELINE_RANK, _global_process_group_list
    ProcessGroupCollection._default = None
    _GLOO_DP_GROUPS.clear()
    _OTHER_GROUPS.clear()
    _GROUP_RANKS.clear()
    _OVERRIDES.clear()
    destroy_global_memory_buffer()
    _global_process_group_list = None
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
