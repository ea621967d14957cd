"""Optimizer state as pieces of the global checkpoint, keyed by the checkpoint keys of the model parameters.

The state of a parameter stored under ``decoder.layers.mlp.linear_fc2.weight`` is stored under
``optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight`` (and ``exp_avg_sq``, ``fp32_param`` for main
parameters) with the same global shape, offsets and replica ids as the parameter, so it reshards exactly as the
parameter does: to another tensor-, pipeline- or data-parallel layout, with or without the distributed optimizer.
"""

from dataclasses import replace
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from megatron.core.optimizer_param_scheduler import ParamGroupOverride
from megatron.core.utils import as_dtensor_like, to_local_if_dtensor

from .dict_utils import nested_values
from .mapping import LocalNonpersistentObject, ShardedStateDict, ShardedTensor, ShardedTensorFactory
from .utils import extract_sharded_tensors_and_factories

ShardedParam = Union[ShardedTensor, ShardedTensorFactory]


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.Tensor]) -> Dict[int, int]:
    """``{id(param): index}`` in the order the optimizer numbers its parameters (first occurrence wins)."""
    mapping = {}
    for index, param in enumerate(optim_params_iter):
        mapping.setdefault(id(param), index)
    return mapping


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.Tensor]
) -> Dict[int, ShardedParam]:
    """``{optimizer parameter index: the model's ShardedTensor (or factory) for that parameter}``.

    ``optim_params_iter`` lists the *model* parameters in the optimizer's order; they are matched by identity with
    the ``data`` of the model's sharded tensors (built with ``keep_vars=True``, as ``sharded_state_dict`` does).
    """
    model_tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    index_of = get_optim_param_to_id_map(optim_params_iter)
    id_to_sharded = {}
    for sharded in nested_values(model_tensors):
        # An FSDP2 shard's data is a view of its DTensor parameter's local piece; it names the parameter.
        index = index_of.get(id(getattr(sharded, "fsdp2_param", sharded.data)))
        if index is not None:
            id_to_sharded[index] = sharded
    return id_to_sharded


def make_sharded_optimizer_tensor(
    model_param: ShardedParam, optim_param: torch.Tensor, prefix: str, **replace_kwargs
) -> ShardedParam:
    """The model parameter's sharded description with ``optim_param`` as data and ``prefix.`` before the key.

    ``optim_param`` must have the parameter's local shape, or be a flat slice of it with ``flattened_range`` given
    in ``replace_kwargs`` (the distributed optimizer's shards).
    """
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=key, data=optim_param, **replace_kwargs)
    with torch.no_grad():
        optim_param = to_local_if_dtensor(optim_param)  # stored like its FSDP2 parameter: this rank's shard
    if "flattened_range" not in replace_kwargs and tuple(optim_param.shape) != tuple(model_param.local_shape):
        raise ValueError(
            f"optimizer state {key!r} has shape {tuple(optim_param.shape)} but its parameter's local shape is "
            f"{tuple(model_param.local_shape)}; only per-element state (such as Adam's moments) can be sharded"
        )
    return replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype, **replace_kwargs)


def optim_state_to_sharding_state(
    optim_state_dict: Dict[str, Any], id_to_sharded_param_map: Dict[int, ShardedTensor], exclude_keys: Tuple[str] = ()
):
    """Replace, in place, every per-parameter tensor of a torch optimizer state dict (``{'state': {index: {name:
    tensor}}}``) by its sharded description ``optimizer.state.<name>.<parameter key>``; ``exclude_keys`` (such as
    ``step``) are dropped."""
    sharded_state = {}
    for index, param_state in optim_state_dict["state"].items():
        if index not in id_to_sharded_param_map:
            raise ValueError(
                f"optimizer parameter {index} has state but no entry in the model's sharded state dict; build the "
                "model sharded state dict from the same model chunks the optimizer steps"
            )
        sharded_state[index] = {
            name: make_sharded_optimizer_tensor(id_to_sharded_param_map[index], value, f"optimizer.state.{name}")
            for name, value in param_state.items()
            if name not in exclude_keys
        }
    optim_state_dict["state"] = sharded_state


# ---- the sharded form of Megatron's optimizers ---------------------------------------------------------------------
#
# What is saved follows Megatron-Core: plain optimizers keep torch's layout with the per-parameter ``step`` replaced by
# one ``state['common_step']``; the distributed optimizer stores ``param_state`` (flat shards, "fully sharded model
# space") and the step in each param group. The param groups' hyperparameters are common (rank 0's copy); on load they
# are matched to this rank's groups by Megatron's group key, since pipeline stages can list their groups in different
# orders. A non-persistent marker tells ``load_state_dict`` that it got this form back rather than torch's.

SHARDED_STATE_MARKER = "sharded_state_format"
_GROUP_KEY_FIELDS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def mark_sharded_state(state_dict: dict) -> dict:
    """Tag an optimizer's sharded state dict so that the loaded result is recognised (the tag is never saved)."""
    state_dict[SHARDED_STATE_MARKER] = LocalNonpersistentObject(True)
    return state_dict


def is_sharded_state(state_dict) -> bool:
    """Whether ``state_dict`` is an optimizer sharded state dict as loaded back (see :func:`mark_sharded_state`)."""
    return isinstance(state_dict, dict) and SHARDED_STATE_MARKER in state_dict


def extract_common_step(torch_state_dict: dict) -> Optional[torch.Tensor]:
    """The step counter every parameter's state shares (None before the first step)."""
    steps = [param_state["step"] for param_state in torch_state_dict["state"].values() if "step" in param_state]
    if not steps:
        return None
    values = {float(step) for step in steps}
    if len(values) > 1:
        raise ValueError(
            f"the optimizer's step differs between parameters ({sorted(values)}); a checkpoint stores one step "
            "shared by all parameters"
        )
    return torch.as_tensor(steps[0]).detach().cpu().clone()


def shard_torch_optimizer_state(
    torch_state_dict: dict, model_sharded_state_dict: ShardedStateDict, model_params: Sequence[torch.Tensor]
) -> dict:
    """Turn ``torch_optimizer.state_dict()`` into its sharded form, in place.

    ``model_params[i]`` is the model parameter behind the optimizer's parameter ``i`` (itself, or the fp16/bf16
    parameter of an fp32 main copy). Per-parameter tensors become sharded under the parameter's key, the step moves to
    ``state['common_step']`` and the groups lose their (rank-local) parameter indices.
    """
    step = extract_common_step(torch_state_dict)
    id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, model_params)
    optim_state_to_sharding_state(torch_state_dict, id_to_sharded, exclude_keys=("step",))
    torch_state_dict["state"]["common_step"] = step
    torch_state_dict["param_groups"] = common_param_groups(torch_state_dict["param_groups"])
    return torch_state_dict


def common_param_groups(param_groups: List[dict]) -> List[dict]:
    """The groups' hyperparameters as stored in the common state: without the rank-local parameter indices, and
    ordered by Megatron's group key where the groups have one, so that every rank holds the same list."""
    groups = [{name: value for name, value in group.items() if name != "params"} for group in param_groups]
    if all(all(field is not None for field in _group_key(group)) for group in groups):
        groups.sort(key=_group_key)
    return groups


def saved_step_and_param_groups(loaded: dict) -> Tuple[Optional[object], List[dict]]:
    """(step, param groups) from a loaded optimizer state of any of Megatron's layouts: the plain one
    (``state.common_step``), the fp16 one (under ``optimizer``) or the distributed one (step in each group)."""
    inner = loaded.get("optimizer") if isinstance(loaded.get("optimizer"), dict) else {}
    groups = inner.get("param_groups", loaded.get("param_groups", []))
    for layout in (loaded, inner):
        step = layout.get("state", {}).get("common_step")
        if step is not None:
            return step, groups
    return next((group["step"] for group in groups if group.get("step") is not None), None), groups


def _group_key(group: dict) -> Tuple:
    return tuple(group.get(field) for field in _GROUP_KEY_FIELDS)


def _param_group_override_keys() -> Tuple[str, ...]:
    """Every key a ParamGroupOverride declares (its annotations, whatever the TypedDict's totality)."""
    return tuple(sorted(ParamGroupOverride.__annotations__))


# What tells saved param groups apart when they are matched to the current ones on load: every per-group override
# and the flags each group gets when it is built. Keys rewritten every step (lr, weight_decay, step) stay out, or a
# group saved at step N would never match its freshly built self.
param_group_identifier_keys = (*_param_group_override_keys(), "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def param_group_identifier(group: dict) -> Tuple:
    """A group's values of param_group_identifier_keys: a missing key counts as None, and NeMo's ``pre_<key>``
    spelling stands in for an absent ``<key>``."""
    return tuple(group[key] if key in group else group.get(f"pre_{key}") for key in param_group_identifier_keys)


def filter_and_reorder_param_groups(current_groups: List[dict], state_dict_groups: List[dict]) -> List[dict]:
    """The saved groups in the order of ``current_groups``, each found by its identifier; the i-th result keeps the
    ``params`` of the i-th saved group (the state dict's parameter order)."""
    saved_by_identifier = {param_group_identifier(group): group for group in state_dict_groups}
    reordered = []
    for group, saved_params in zip(current_groups, [group["params"] for group in state_dict_groups]):
        identifier = param_group_identifier(group)
        if identifier not in saved_by_identifier:
            available = "\n".join(str(key) for key in saved_by_identifier)
            raise ValueError(
                f"Could not find parameter group with key {identifier} in loaded checkpoint.\n"
                f"Available keys:\n{available}\nParameter group key definition: {param_group_identifier_keys}"
            )
        saved = saved_by_identifier[identifier]
        saved["params"] = saved_params
        reordered.append(saved)
    return reordered


def load_torch_optimizer_state(
    optimizer: torch.optim.Optimizer, per_param_state: Dict[int, Dict[str, torch.Tensor]], step, saved_groups
) -> None:
    """Load ``per_param_state`` (by the optimizer's parameter index), the shared ``step`` and the saved groups'
    hyperparameters into ``optimizer``; this rank keeps its own parameters in every group."""
    current_groups = optimizer.param_groups
    saved_by_identifier = {param_group_identifier(group): group for group in saved_groups}
    saved_by_key = {_group_key(group): group for group in saved_groups}
    torch_groups, first_index = [], 0
    for position, group in enumerate(current_groups):
        key = _group_key(group)
        if any(field is not None for field in key):
            # The full identifier tells apart groups that differ only by an override (say max_lr); a run resumed
            # with a changed override finds its group by the structural key alone.
            saved = saved_by_identifier.get(param_group_identifier(group)) or saved_by_key.get(key, {})
        else:  # groups built without Megatron's keys can only be matched by position
            saved = saved_groups[position] if len(saved_groups) == len(current_groups) else {}
        hyperparameters = {name: saved.get(name, value) for name, value in group.items() if name != "params"}
        count = len(group["params"])
        torch_groups.append({**hyperparameters, "params": list(range(first_index, first_index + count))})
        first_index += count
    state = {}
    for index, param_state in per_param_state.items():
        state[index] = dict(param_state)
        if step is not None:
            state[index]["step"] = torch.tensor(float(step), dtype=torch.float32)
    optimizer.load_state_dict({"state": state, "param_groups": torch_groups})
    _state_as_dtensors_like_params(optimizer)


def _state_as_dtensors_like_params(optimizer: torch.optim.Optimizer) -> None:
    """Give the per-element state of FSDP2 (DTensor) parameters their parameter's layout: it was loaded as plain
    local shards (or whole tensors), and torch optimizers cannot mix DTensors with plain tensors."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param_state = optimizer.state.get(param, {})
            for name, value in param_state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    param_state[name] = as_dtensor_like(value, param)
