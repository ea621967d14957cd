"""ProcessGroupCollection: the process groups a module needs, passed explicitly.

Modules take ``pg_collection=None`` and fall back to :meth:`ProcessGroupCollection.use_mpu_process_groups`, which
reads the groups that :func:`megatron.core.parallel_state.initialize_model_parallel` created. Passing a collection
explicitly lets one process hold several models with different layouts (and keeps model code free of globals).
"""

from dataclasses import dataclass, fields
from typing import Optional

import torch.distributed as dist


@dataclass
class ProcessGroupCollection:
    """Process groups by Megatron's short names.

    tp: tensor-parallel; pp: pipeline-parallel; mp: model-parallel (tp x pp); cp: context-parallel;
    tp_cp: tensor x context; ep: expert-parallel; expt_tp: expert tensor-parallel; tp_ep: expert tensor x expert;
    tp_ep_pp: expert tensor x expert x pipeline; dp: data-parallel; dp_cp: data x context (what gradients are
    reduced over); expt_dp: expert data-parallel; tp_dp: tensor x data; tp_dp_cp: tensor x data x context;
    embd: first/last pipeline stages sharing the word embedding; pos_embd: the stage holding position embeddings.
    """

    tp: Optional[dist.ProcessGroup] = None
    pp: Optional[dist.ProcessGroup] = None
    mp: Optional[dist.ProcessGroup] = None
    cp: Optional[dist.ProcessGroup] = None
    tp_cp: Optional[dist.ProcessGroup] = None
    ep: Optional[dist.ProcessGroup] = None
    expt_tp: Optional[dist.ProcessGroup] = None
    tp_ep: Optional[dist.ProcessGroup] = None
    tp_ep_pp: Optional[dist.ProcessGroup] = None
    dp: Optional[dist.ProcessGroup] = None
    dp_cp: Optional[dist.ProcessGroup] = None
    expt_dp: Optional[dist.ProcessGroup] = None
    tp_dp: Optional[dist.ProcessGroup] = None
    tp_dp_cp: Optional[dist.ProcessGroup] = None
    embd: Optional[dist.ProcessGroup] = None
    pos_embd: Optional[dist.ProcessGroup] = None

    @classmethod
    def use_mpu_process_groups(cls, required_pgs=None) -> "ProcessGroupCollection":
        """Build a collection from the groups ``parallel_state.initialize_model_parallel`` created.

        ``required_pgs`` (a list of names such as ``['tp', 'pp']``) limits the collection to those groups.
        """
        from megatron.core import parallel_state

        known = {f.name for f in fields(cls)}
        names = known if required_pgs is None else list(required_pgs)
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"unknown process group name(s) {unknown}; known names are {sorted(known)}")
        groups = parallel_state.get_process_group_collection()
        return cls(**{name: getattr(groups, name) for name in names})

    def __repr__(self) -> str:
        present = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        return f"ProcessGroupCollection({', '.join(present)})"


def tp_group_or_default(pg_collection: Optional[ProcessGroupCollection]) -> dist.ProcessGroup:
    """The tensor-parallel group of ``pg_collection``, or the global one when it is None."""
    if pg_collection is not None and pg_collection.tp is not None:
        return pg_collection.tp
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()
