"""Helpers for nested dicts/lists (state dicts): map over leaves, split by a predicate, merge, compare."""

from typing import Any, Callable, Iterable, Iterator, Tuple, Union

import torch

Nested = Union[dict, list, Any]


def extract_matching_values(
    x: Union[dict, list], predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Union[dict, list], Union[dict, list]]:
    """Split ``x`` into (leaves matching ``predicate``, the rest), both keeping ``x``'s nesting.

    A sub-container with nothing on one side is left out of that side (empty ones stay with the rest). Lists keep
    their order; with ``return_lists_as_dicts`` they become ``{index: value}`` dicts so the two halves can be merged
    back by index.
    """
    if isinstance(x, dict):
        items = x.items()
    elif isinstance(x, list):
        items = enumerate(x)
    else:
        raise TypeError(f"extract_matching_values expects a dict or a list, got {type(x).__name__}")
    matched, other = {}, {}
    for k, v in items:
        if isinstance(v, (dict, list)):
            sub_matched, sub_other = extract_matching_values(v, predicate, return_lists_as_dicts)
            if sub_matched:
                matched[k] = sub_matched
            if sub_other or not v:  # an empty container is kept, on the non-matching side
                other[k] = sub_other
        elif predicate(v):
            matched[k] = v
        else:
            other[k] = v
    if isinstance(x, list) and not return_lists_as_dicts:
        return list(matched.values()), list(other.values())
    return matched, other


def nested_values(x: Nested) -> Iterator[Any]:
    """Every leaf of ``x``, depth first."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Nested) -> Iterator[Tuple[Any, Any]]:
    """Every (innermost key or index, leaf) pair of ``x``, depth first."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield k, v


def dict_map(f: Callable, d: dict):
    """Apply ``f`` to every leaf of the nested dict ``d`` in place (lists are leaves)."""
    for k, v in d.items():
        if isinstance(v, dict):
            dict_map(f, v)
        else:
            d[k] = f(v)


def dict_map_with_key(f: Callable, d: dict):
    """Replace every leaf of the nested dict ``d`` in place by ``f(key, leaf)``, ``key`` being the innermost key
    (lists are leaves)."""
    for k, v in d.items():
        if isinstance(v, dict):
            dict_map_with_key(f, v)
        else:
            d[k] = f(k, v)


def inspect_types(x: Any, prefix: Tuple = (), indent: int = 4):
    """Print the nesting of ``x`` with each leaf's type (and a tensor's shape and dtype), one line per entry,
    nested entries ``indent`` spaces further in: a quick look at what a state dict holds."""
    for line in _type_lines(x, prefix, indent):
        print(line)


def _type_lines(x: Any, prefix: Tuple, indent: int) -> Iterator[str]:
    pad = " " * (indent * len(prefix))
    if isinstance(x, (dict, list)):
        for k, v in x.items() if isinstance(x, dict) else enumerate(x):
            if isinstance(v, (dict, list)):
                yield f"{pad}{k}: {type(v).__name__} of {len(v)}"
                yield from _type_lines(v, prefix + (k,), indent)
            else:
                yield f"{pad}{k}: {_describe_leaf(v)}"
        return
    yield f"{pad}{_describe_leaf(x)}"


def _describe_leaf(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor {tuple(value.shape)} {value.dtype}"
    return type(value).__name__


def dict_list_map_inplace(f: Callable, x: Nested) -> Nested:
    """Replace every leaf of ``x`` (through dicts and lists) by ``f(leaf)`` in place; returns ``x`` (or ``f(x)``
    when ``x`` itself is a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
        return x
    return f(x)


def dict_list_map_outplace(f: Callable, x: Nested) -> Nested:
    """A new nested structure with ``f(leaf)`` at every leaf of ``x``."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: Union[dict, list], x2: Union[dict, list], key: Tuple[Union[int, str], ...] = ()):
    """Merge ``x2`` into ``x1`` in place: dicts by key, lists by position (``x2`` may be an ``{index: value}`` dict
    for a list); anywhere else ``x2``'s value replaces ``x1``'s."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, (list, dict)):
        items = x2.items() if isinstance(x2, dict) else enumerate(x2)
        for i, v2 in items:
            if not isinstance(i, int) or i >= len(x1):
                raise ValueError(f"cannot merge index {i!r} at {key} into a list of length {len(x1)}")
            x1[i] = merge(x1[i], v2, key + (i,))
        return x1
    return x2


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """(keys only in x1, keys only in x2, keys whose leaves differ) -- tensors compared by value."""
    only_left, only_right, mismatch = [], [], []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            left, right, diffs = diff(x1[k], x2[k], prefix + (k,))
            only_left += left
            only_right += right
            mismatch += diffs
    elif isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (v1, v2) in enumerate(zip(x1, x2)):
            left, right, diffs = diff(v1, v2, prefix + (i,))
            only_left += left
            only_right += right
            mismatch += diffs
    elif isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        if x1.shape != x2.shape or not torch.equal(x1, x2):
            mismatch.append(prefix)
    elif type(x1) is not type(x2) or x1 != x2:
        mismatch.append(prefix)
    return only_left, only_right, mismatch


def map_reduce(
    xs: Iterable, key_fn: Callable = lambda x: x, value_fn: Callable = lambda x: x, reduce_fn: Callable = lambda x: x
) -> dict:
    """Group ``xs`` by ``key_fn``, map each by ``value_fn`` and reduce each group with ``reduce_fn``."""
    groups = {}
    for x in xs:
        groups.setdefault(key_fn(x), []).append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
