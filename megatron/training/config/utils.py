"""Cleaning config dicts written by older versions before they are instantiated.

A dataclass field declared with ``init=False`` is computed in ``__post_init__``; an older writer may have saved
it, and passing it back to ``__init__`` would fail. ``sanitize_dataclass_config`` drops such keys, finding them by
looking up each node's ``_target_`` class (only targets the allow-list admits are imported).
"""

import importlib
import logging
from dataclasses import fields as dataclass_fields
from dataclasses import is_dataclass
from functools import lru_cache
from typing import Any

from megatron.training.config.instantiate_utils import target_allowlist

logger = logging.getLogger(__name__)


def sanitize_dataclass_config(config: dict[str, Any], _visited: set | None = None) -> dict[str, Any]:
    """A copy of ``config`` (nested dicts and lists of dicts included) without the keys that are ``init=False``
    fields of the node's ``_target_`` dataclass. Anything that is not a dict is returned unchanged; nodes whose
    target cannot be resolved keep all their keys."""
    if not isinstance(config, dict):
        return config
    if _visited is None:
        _visited = set()
    if id(config) in _visited:
        return config
    _visited.add(id(config))

    target = config.get("_target_")
    target_class = _resolve_target_class(target) if isinstance(target, str) else None
    skipped = _get_init_false_fields(target_class) if target_class is not None else frozenset()

    sanitized = {}
    for key, value in config.items():
        if key in skipped:
            logger.debug("Dropping init=False field %r of %s from a saved config", key, target_class.__name__)
            continue
        if isinstance(value, dict):
            value = sanitize_dataclass_config(value, _visited)
        elif isinstance(value, list):
            value = [sanitize_dataclass_config(item, _visited) if isinstance(item, dict) else item for item in value]
        sanitized[key] = value
    return sanitized


def _resolve_target_class(target: str) -> type | None:
    """The object ``module.Name`` names, or None (with a warning) when the allow-list refuses it or it cannot be
    imported."""
    if not target_allowlist.is_allowed(target):
        logger.warning("Not resolving _target_ '%s': it is not in the allowlist", target)
        return None
    try:
        module_path, name = target.rsplit(".", 1)
        return getattr(importlib.import_module(module_path), name, None)
    except (ValueError, ImportError, AttributeError) as error:
        logger.warning("Could not resolve _target_ '%s': %s", target, error)
        return None


@lru_cache(maxsize=128)
def _get_init_false_fields(target_class: type) -> frozenset[str]:
    """Names of the ``init=False`` fields of a dataclass; empty for anything else."""
    if not is_dataclass(target_class):
        return frozenset()
    return frozenset(f.name for f in dataclass_fields(target_class) if not f.init)
