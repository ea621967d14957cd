"""Making process groups: ``torch.distributed.new_group`` with a record of this rank's groups, nested
(hierarchical) groups, and Megatron's per-group NCCL options.

parallel_state builds its layout with these; they hold no layout themselves. Megatron's public path for them is
``megatron.core.parallel_state``, which re-exports them.
"""

import logging
from datetime import timedelta
from math import prod
from typing import List, Optional

import torch.distributed as dist

from megatron.core.public_api import public_api
from megatron.core.rank_generator import generate_masked_orthogonal_rank_groups
from megatron.core.utils import synchronize_device

logger = logging.getLogger(__name__)

# The groups this rank belongs to, for update_pg_timeout; None stands for the default (world) group.
_global_process_group_list: Optional[List[Optional[dist.ProcessGroup]]] = None


@public_api("megatron.core.parallel_state")
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


def destroy_created_groups() -> None:
    """Destroy every group ``create_group`` made on this rank, then forget them (destroy_model_parallel calls this).

    Dropping our references is not enough: torch.distributed keeps each group, with its sockets and its gloo/NCCL
    threads, in its own registry until ``destroy_process_group``; without this every initialise/destroy cycle leaked
    dozens of file descriptors and threads per rank.
    """
    global _global_process_group_list
    for group in _global_process_group_list or []:
        if group is None or not dist.is_initialized():
            continue
        try:
            dist.destroy_process_group(group)
        except ValueError:
            # Already gone: the caller destroyed it, or tore the whole world down (and maybe started a new one).
            pass
    _global_process_group_list = None


@public_api("megatron.core.parallel_state")
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


@public_api("megatron.core.parallel_state")
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


@public_api("megatron.core.parallel_state")
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


@public_api("megatron.core.parallel_state")
def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set ``nccl_comm_cfgs[pg_name][key] = value`` for ``key_value_pair = (key, value)``, adding the group if new."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


def read_nccl_comm_cfgs(path: Optional[str]) -> dict:
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
