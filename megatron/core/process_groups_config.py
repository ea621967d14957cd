"""ProcessGroupCollection: the process groups a module needs, passed explicitly.

Modules take ``pg_collection=None`` and fall back to :meth:`ProcessGroupCollection.use_mpu_process_groups`, which
reads the groups that :func:`megatron.core.parallel_state.initialize_model_parallel` created and stored in
``ProcessGroupCollection._default``. Passing a collection explicitly lets one process hold several models with
different layouts (and keeps model code free of globals).

As in Megatron 0.19, a collection holds only the groups it was given, and a group that was never set reads as
``None`` (``ProcessGroupCollection().cp is None``), the same as one set to ``None``; a name that is not a group is
still an AttributeError. Code that accepts partial collections therefore tests ``pgs.cp is None``, not ``hasattr``.
"""

import importlib
from dataclasses import dataclass, field, fields
from typing import ClassVar, Dict, List, Optional

import torch.distributed as dist

# Names that moved to a module above this one; looked up there on first use (PEP 562), so this module imports
# nothing of ours.
_MOVED = {"tp_group_or_default": "megatron.core.parallel_state"}


def __getattr__(name):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ProcessGroupHelperMeta(type):
    """Metaclass for helper classes whose ``virtual_pipeline_model_parallel_size`` must go through a setter.

    Assigning the attribute on the class directly would skip whatever bookkeeping the class's
    ``set_virtual_pipeline_model_parallel_size`` does, so it is refused.
    """

    def __setattr__(cls, name, value):
        if name == "virtual_pipeline_model_parallel_size":
            raise AttributeError(
                f"Cannot set '{name}' directly. Use set_virtual_pipeline_model_parallel_size() method instead."
            )
        super().__setattr__(name, value)


@dataclass
class ProcessGroupCollection:
    """Process groups by Megatron's short names (every field is optional and set by keyword).

    Model parallelism: tp tensor; pp pipeline; mp model (tp x pp); embd first/last stages sharing the word
    embedding; pos_embd the stage holding position embeddings; cp context; tp_cp tensor x context; hcp hierarchical
    context-parallel groups (a list); ep expert; expt_tp expert tensor; tp_ep expert tensor x expert; tp_ep_pp
    expert tensor x expert x pipeline; tp_ep_pp_with_egtp_remat the same with expert GTP weight rematerialisation.
    Data parallelism: tp_dp_cp tensor x data x context; dp data; dp_cp data x context (what gradients are reduced
    over); dp_cp_gtp_remat / expt_dp_gtp_remat the data groups with GTP rematerialisation folded in; dp_cp_ag /
    expt_dp_ag separate communicators for parameter all-gathers; gtp_remat / expt_gtp_remat the GTP
    rematerialisation groups; expt_dp expert data; intra_dp_cp / intra_expt_dp the data groups inside one
    distributed-optimizer instance; inter_dist_opt across instances; intra_dist_opt all ranks of one instance.
    """

    tp: dist.ProcessGroup = field(init=False)
    pp: dist.ProcessGroup = field(init=False)
    mp: dist.ProcessGroup = field(init=False)
    embd: dist.ProcessGroup = field(init=False)
    pos_embd: dist.ProcessGroup = field(init=False)
    cp: dist.ProcessGroup = field(init=False)
    tp_cp: dist.ProcessGroup = field(init=False)
    hcp: List[dist.ProcessGroup] = field(init=False)
    ep: dist.ProcessGroup = field(init=False)
    expt_tp: dist.ProcessGroup = field(init=False)
    tp_ep: dist.ProcessGroup = field(init=False)
    tp_ep_pp: dist.ProcessGroup = field(init=False)
    tp_ep_pp_with_egtp_remat: dist.ProcessGroup = field(init=False)
    tp_dp_cp: dist.ProcessGroup = field(init=False)
    dp: dist.ProcessGroup = field(init=False)
    dp_cp: dist.ProcessGroup = field(init=False)
    dp_cp_gtp_remat: dist.ProcessGroup = field(init=False)
    dp_cp_ag: dist.ProcessGroup = field(init=False)
    gtp_remat: dist.ProcessGroup = field(init=False)
    expt_gtp_remat: dist.ProcessGroup = field(init=False)
    expt_dp: dist.ProcessGroup = field(init=False)
    expt_dp_gtp_remat: dist.ProcessGroup = field(init=False)
    expt_dp_ag: dist.ProcessGroup = field(init=False)
    intra_dp_cp: dist.ProcessGroup = field(init=False)
    intra_expt_dp: dist.ProcessGroup = field(init=False)
    inter_dist_opt: dist.ProcessGroup = field(init=False)
    intra_dist_opt: dist.ProcessGroup = field(init=False)

    # The collection parallel_state.initialize_model_parallel built (None before it and after
    # destroy_model_parallel). It lives here, not in parallel_state, so this module stays plain data.
    _default: ClassVar[Optional["ProcessGroupCollection"]] = None

    def __init__(self, **groups):
        known = {f.name for f in fields(self)}
        for name, group in groups.items():
            if name not in known:
                raise ValueError(f"Unknown attribute: {name}")
            setattr(self, name, group)

    def __getattr__(self, name: str):
        # Only reached for names not set on the instance: an unset group is None, anything else does not exist.
        if name in _FIELD_NAMES:
            return None
        raise AttributeError(f"'ProcessGroupCollection' object has no attribute '{name}'")

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: Optional[List[str]] = None) -> "ProcessGroupCollection":
        """Build a collection from the groups ``parallel_state.initialize_model_parallel`` created.

        ``required_pgs`` (a list of names such as ``['tp', 'pp']``) limits the collection to those groups. Groups
        the layout does not create (``hcp``, ``inter_dist_opt``, the GTP and all-gather groups when not asked for)
        are present as ``None``.
        """
        known = [f.name for f in fields(cls)]
        names = known if required_pgs is None else list(required_pgs)
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"Invalid process groups requested: {unknown}; known names are {known}")
        everything = ProcessGroupCollection._default
        if everything is None:
            raise RuntimeError("model parallel groups are not initialized; call initialize_model_parallel() first")
        return cls(**{name: getattr(everything, name, None) for name in names})

    def __repr__(self) -> str:
        present = []
        for f in fields(self):
            group = getattr(self, f.name)
            if group is not None:
                present.append(f"{f.name}({_size_of(group)})")
        return f"ProcessGroupCollection({', '.join(present)})" if present else "ProcessGroupCollection(empty)"


_FIELD_NAMES = frozenset(f.name for f in fields(ProcessGroupCollection))


def _size_of(group) -> str:
    if isinstance(group, list):  # hcp: one group per hierarchy level
        return "[" + ", ".join(str(g.size()) for g in group) + "]"
    return str(group.size())


@dataclass
class MultiModuleProcessGroupCollection:
    """Process groups of a model made of several modules (e.g. a vision encoder and a language model), by name.

    ``module_pgs`` maps each module's name to its :class:`ProcessGroupCollection`; ``language_model_module_name``
    names the module whose output carries the loss (it must be one of ``module_pgs``).
    """

    module_pgs: Dict[str, ProcessGroupCollection]
    language_model_module_name: Optional[str] = None

    def __post_init__(self):
        if not self.module_pgs:
            raise ValueError("MultiModuleProcessGroupCollection needs at least one module in module_pgs")
        for name, pgs in self.module_pgs.items():
            if not isinstance(pgs, ProcessGroupCollection):
                raise ValueError(
                    f"module_pgs[{name!r}] is a {type(pgs).__name__}; every value must be a ProcessGroupCollection"
                )
        if self.language_model_module_name is not None and self.language_model_module_name not in self.module_pgs:
            raise ValueError(
                f"language_model_module_name={self.language_model_module_name!r} is not one of the modules "
                f"{sorted(self.module_pgs)}"
            )
