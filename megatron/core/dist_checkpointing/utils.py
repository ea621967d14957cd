"""Split a sharded state dict by leaf type, and rename the keys of its sharded leaves."""

from typing import Dict, Tuple

from .dict_utils import dict_list_map_inplace, extract_matching_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensor leaves, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensor and ShardedTensorFactory leaves, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory)))


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensor, ShardedTensorFactory and LocalNonpersistentObject leaves, everything else)."""
    return extract_matching_values(
        sharded_state_dict,
        lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject)),
    )


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(every ShardedBase leaf: tensors, objects, factories; everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(the LocalNonpersistentObject leaves, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def _is_keyed_leaf(x) -> bool:
    return isinstance(x, (ShardedTensor, ShardedObject, ShardedTensorFactory))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded leaf, in place."""

    def add_prefix(x):
        if _is_keyed_leaf(x):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add_prefix, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the key of every sharded leaf, in place; every key must start with
    ``old_prefix``."""

    def replace_prefix(x):
        if _is_keyed_leaf(x):
            if not x.key.startswith(old_prefix):
                raise ValueError(f"sharded key {x.key!r} does not start with the prefix {old_prefix!r} to replace")
            x.key = f"{new_prefix}{x.key[len(old_prefix) :]}"
        return x

    dict_list_map_inplace(replace_prefix, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename sharded keys by the first matching ``{old_prefix: new_prefix}`` entry, in place; keys that match no
    entry are left alone (e.g. the local spec's ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``)."""

    def map_prefix(x):
        if _is_keyed_leaf(x):
            for old_prefix, new_prefix in prefix_map.items():
                if x.key.startswith(old_prefix):
                    x.key = f"{new_prefix}{x.key[len(old_prefix) :]}"
                    break
        return x

    dict_list_map_inplace(map_prefix, sharded_state_dict)
