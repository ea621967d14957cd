"""Megatron-LM's ``megatron.training.yaml_arguments``: loading and validating a ``--yaml-cfg FILE`` run, and the
TransformerConfig of one. Reading the file (its layout, ``${VAR}`` expansion, the checks) is ``yaml_config``'s;
the parser merges its settings as defaults, so these are thin shims over ``arguments``.
"""

import argparse
import dataclasses
from typing import Any, Dict

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.argument_utils import core_transformer_config_from_args
from megatron.training.arguments import parse_args_list, validate_args
from megatron.training.yaml_config import ACTIVATIONS, SECTIONS, substitute_environment, yaml_settings  # noqa: F401


def load_yaml(yaml_path: str) -> argparse.Namespace:
    """The argument namespace ``parse_args`` gives for ``--yaml-cfg yaml_path`` and no other flag."""
    return parse_args_list(["--yaml-cfg", yaml_path])


def validate_yaml(args, defaults={}):
    """Megatron-LM's validation of a ``--yaml-cfg`` run. Here the file's settings are already merged into the
    argument namespace (as the parser's defaults), so this is ``validate_args``."""
    return validate_args(args, defaults)


def core_config_from_args(args, dataclass=TransformerConfig) -> Dict[str, Any]:
    """``{field: value}`` for every field of ``dataclass`` that ``args`` has an attribute of the same name for."""
    fields = dataclasses.fields(dataclass)
    return {field.name: getattr(args, field.name) for field in fields if hasattr(args, field.name)}


def core_transformer_config_from_yaml(args, transfomer_key="language_model") -> TransformerConfig:
    """The TransformerConfig of a ``--yaml-cfg`` run. The ``language_model:`` section (``transfomer_key``, Megatron-
    LM's spelling) is merged into the flat arguments when the file is read, so the config is built from them exactly
    as for a command line (``core_transformer_config_from_args``)."""
    if transfomer_key != "language_model":
        raise ValueError(f"the transformer settings are read from the language_model section, not {transfomer_key!r}")
    return core_transformer_config_from_args(args)


def env_constructor(loader, node) -> str:
    """A PyYAML constructor expanding ``${VAR}`` in a scalar from the environment (for a loader that registers it,
    as Megatron-LM does with ``yaml.add_constructor``); a variable that is not set is a ValueError naming it."""
    return substitute_environment(loader.construct_scalar(node))
