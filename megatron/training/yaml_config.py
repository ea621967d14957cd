"""Reading a ``--yaml-cfg FILE`` into ``{argument dest: value}``: the command-line settings, in Megatron-LM's layout.

The file is a mapping. Top-level keys are argument names (the flag without ``--``, dashes as underscores:
``micro_batch_size: 4``). Two sections follow Megatron-LM's YAML configs:

- ``model_parallel:`` holds ``ModelParallelConfig`` field names (``tensor_model_parallel_size: 2``, ``bf16: true``);
- ``language_model:`` holds ``TransformerConfig`` field names (``num_layers: 24``, ``layernorm_epsilon: 1.e-5``,
  ``activation_func: swiglu``); ``num_query_groups: 8`` there turns on grouped-query attention, as in Megatron-LM.

Either section may also hold plain argument names. A field given with its default value, or with null, changes
nothing. ``${VAR}`` in a string is replaced by the environment variable ``VAR``. Values get the flag's type and
choices check; every unknown key, bad value or missing variable is a ``ValueError`` naming the file and the key.
The settings become the parser's defaults, so flags on the command line still override them, and the result goes
through ``validate_args`` like any command line.
"""

import argparse
import dataclasses
import difflib
import os
import re
from typing import Any, Dict

import yaml

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.argument_utils import TRANSFORMER_CONFIG_RENAMES

SECTIONS = {"model_parallel": ModelParallelConfig, "language_model": TransformerConfig}


ACTIVATIONS = {"gelu": {}, "swiglu": {"swiglu": True}, "squaredrelu": {"squared_relu": True}}


_ENV_VARIABLE = re.compile(r"\$\{([^}]*)\}")


def substitute_environment(text: str) -> str:
    """``text`` with each ``${VAR}`` replaced by the environment variable ``VAR`` (unset: a ValueError naming it)."""

    def substitute(match):
        name = match.group(1)
        if name not in os.environ:
            raise ValueError(f"environment variable {name} (in {text!r}) is not set")
        return os.environ[name]

    return _ENV_VARIABLE.sub(substitute, text)


def yaml_settings(yaml_path: str, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """The settings of a YAML config file as ``{argument dest: value}``, checked against ``parser``'s flags."""
    document = _read(yaml_path)
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    reader = _SettingsReader(yaml_path, actions)
    for key, value in document.items():
        if key in SECTIONS:
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{yaml_path}: section {key}: must be a mapping of settings, got {value!r}")
            for name, field_value in (value or {}).items():
                reader.read_section_entry(key, name, field_value, value)
        else:
            reader.read_flat_entry(key, value)
    return reader.settings


def _read(yaml_path: str) -> dict:
    try:
        with open(yaml_path, encoding="utf-8") as stream:
            document = yaml.safe_load(stream)
    except FileNotFoundError:
        raise ValueError(f"--yaml-cfg {yaml_path}: file not found") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--yaml-cfg {yaml_path}: not valid YAML: {error}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ValueError(
            f"--yaml-cfg {yaml_path}: the file must hold a mapping of settings, got {type(document).__name__}"
        )
    return _expand_environment(document, yaml_path)


def _expand_environment(value, yaml_path: str):
    if isinstance(value, dict):
        return {key: _expand_environment(item, yaml_path) for key, item in value.items()}
    if isinstance(value, list):
        return [_expand_environment(item, yaml_path) for item in value]
    if isinstance(value, str):
        try:
            return substitute_environment(value)
        except ValueError as error:
            raise ValueError(f"{yaml_path}: {error}") from None
    return value


class _SettingsReader:
    """Collects ``dest -> value`` from the entries of one file, converting each value as its flag would."""

    def __init__(self, yaml_path: str, actions: Dict[str, argparse.Action]):
        self.yaml_path = yaml_path
        self.actions = actions
        self.settings: Dict[str, Any] = {}
        self._origin: Dict[str, str] = {}

    def read_flat_entry(self, key: str, value) -> None:
        if key not in self.actions:
            raise ValueError(self._unknown(key, key, list(self.actions) + list(SECTIONS)))
        self._set(key, self._convert(key, self.actions[key], value), key)

    def read_section_entry(self, section: str, name: str, value, section_values: dict) -> None:
        where = f"{section}.{name}"
        config_class = SECTIONS[section]
        fields = {field.name: field for field in dataclasses.fields(config_class)}
        if name not in fields:
            if name in self.actions:  # Megatron-LM merges the sections into the arguments
                self._set(name, self._convert(where, self.actions[name], value), where)
                return
            raise ValueError(self._unknown(where, name, list(fields) + list(self.actions)))
        special = self._special_field(section, name, value, section_values)
        if special is not None:
            for dest, dest_value in special.items():
                self._set(dest, dest_value, where)
            return
        dest = TRANSFORMER_CONFIG_RENAMES.get(name, name) if section == "language_model" else name
        if dest in self.actions:
            self._set(dest, self._convert(where, self.actions[dest], value), where)
        elif value is not None and value != fields[name].default:
            raise ValueError(
                f"{self.yaml_path}: {where}: {value!r} cannot be set here (the field has no command-line "
                "equivalent: it is derived from other settings or not supported); remove it"
            )

    def _special_field(self, section: str, name: str, value, section_values: dict):
        """Megatron-LM's YAML fields that map onto flags other than by name; None for an ordinary field."""
        if section != "language_model":
            return None
        if name == "activation_func":
            if value not in ACTIVATIONS:
                raise ValueError(
                    f"{self.yaml_path}: language_model.activation_func: {value!r} is not one of {list(ACTIVATIONS)}"
                )
            return {"swiglu": False, "squared_relu": False, **ACTIVATIONS[value]}
        if name == "gated_linear_unit":
            if value and section_values.get("activation_func") != "swiglu":
                raise ValueError(
                    f"{self.yaml_path}: language_model.gated_linear_unit: a gated MLP comes with "
                    "activation_func: swiglu here; set that instead"
                )
            return {}
        if name == "num_query_groups":
            return {} if value is None else {"group_query_attention": True, "num_query_groups": value}
        if name == "persist_layer_norm":
            return {"no_persist_layer_norm": not value}
        if name == "bias_activation_fusion":
            return {"bias_gelu_fusion": bool(value)}
        return None

    def _convert(self, where: str, action: argparse.Action, value):
        if value is None:
            return None
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                raise ValueError(f"{self.yaml_path}: {where}: must be true or false, got {value!r}")
            return value
        if action.nargs in ("*", "+") or isinstance(action.nargs, int):
            items = value.split() if isinstance(value, str) else value if isinstance(value, list) else [value]
            if isinstance(action.nargs, int) and len(items) != action.nargs:
                raise ValueError(f"{self.yaml_path}: {where}: takes {action.nargs} values, got {value!r}")
            return [self._convert_one(where, action, item) for item in items]
        return self._convert_one(where, action, value)

    def _convert_one(self, where: str, action: argparse.Action, value):
        kind = action.type
        try:
            if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                converted = float(value)
            elif kind is int and isinstance(value, int) and not isinstance(value, bool):
                converted = value
            elif kind is str or kind is None:
                converted = value if isinstance(value, str) else str(value)
            elif isinstance(value, str):
                converted = kind(value)
            else:
                raise ValueError(f"expected {getattr(kind, '__name__', kind)}")
        except (ValueError, TypeError, argparse.ArgumentTypeError) as error:
            raise ValueError(f"{self.yaml_path}: {where}: {value!r} is not a valid value ({error})") from None
        if action.choices is not None and converted not in action.choices:
            choices = ", ".join(str(choice) for choice in action.choices)
            raise ValueError(f"{self.yaml_path}: {where}: {value!r} is not one of {choices}")
        return converted

    def _set(self, dest: str, value, where: str) -> None:
        if dest in self.settings and self.settings[dest] != value:
            raise ValueError(
                f"{self.yaml_path}: {where} and {self._origin[dest]} set {dest} to different values "
                f"({value!r} and {self.settings[dest]!r}); keep one"
            )
        self.settings[dest] = value
        self._origin[dest] = where

    def _unknown(self, where: str, name: str, known) -> str:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return (
            f"{self.yaml_path}: unknown setting {where}{hint} (keys are argument names such as micro_batch_size, "
            f"or the {' and '.join(SECTIONS)} sections)"
        )
