"""Where a rank sits in its pipeline: first/last stage, neighbours, and virtual-stage position.

Everything here is computed from an explicit pipeline process group (as in ``pg_collection.pp``) rather than from
global state, so the same helpers serve several pipelines (or none initialised through ``parallel_state``).
Ranks returned are global ranks, ready for ``torch.distributed`` point-to-point calls.
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.utils import make_viewless_tensor


def _global_rank(pp_group: dist.ProcessGroup, group_rank: int) -> int:
    return dist.get_global_rank(pp_group, group_rank)


def is_pp_first_stage(pp_group: dist.ProcessGroup) -> bool:
    """Whether this rank is the first stage of ``pp_group``."""
    return pp_group.rank() == 0


def is_pp_last_stage(pp_group: dist.ProcessGroup) -> bool:
    """Whether this rank is the last stage of ``pp_group``."""
    return pp_group.rank() == pp_group.size() - 1


def is_vp_first_stage(vp_stage: int, vp_size: Optional[int]) -> bool:
    """Whether model chunk ``vp_stage`` is the first of this rank's ``vp_size`` chunks (always, without chunks)."""
    if vp_size is None or vp_size <= 1:
        return True
    return vp_stage == 0


def is_vp_last_stage(vp_stage: int, vp_size: Optional[int]) -> bool:
    """Whether model chunk ``vp_stage`` is the last of this rank's ``vp_size`` chunks (always, without chunks)."""
    if vp_size is None or vp_size <= 1:
        return True
    return vp_stage == vp_size - 1


def get_pp_first_rank(pp_group: dist.ProcessGroup) -> int:
    """Global rank of the first stage of ``pp_group``."""
    return _global_rank(pp_group, 0)


def get_pp_last_rank(pp_group: dist.ProcessGroup) -> int:
    """Global rank of the last stage of ``pp_group``."""
    return _global_rank(pp_group, pp_group.size() - 1)


def get_pp_next_rank(pp_group: dist.ProcessGroup) -> int:
    """Global rank of the next stage; the last stage's next is the first (the ring virtual stages wrap around)."""
    return _global_rank(pp_group, (pp_group.rank() + 1) % pp_group.size())


def get_pp_prev_rank(pp_group: dist.ProcessGroup) -> int:
    """Global rank of the previous stage; the first stage's previous is the last."""
    return _global_rank(pp_group, (pp_group.rank() - 1) % pp_group.size())


def make_viewless(e):
    """``e`` as a tensor that is not a view, keeping its autograd graph.

    A stage output that is a view keeps its base alive, so freeing the output after sending it
    (``deallocate_pipeline_outputs``) would release nothing; this drops the ``_base`` link without a copy.
    Non-tensors and tensors that are not views are returned unchanged.
    """
    if not isinstance(e, torch.Tensor):
        return e
    return make_viewless_tensor(inp=e, requires_grad=e.requires_grad, keep_graph=True)
