"""Config containers: dataclasses of config dataclasses that read and write themselves as ``_target_`` dicts and
YAML files.

``to_dict`` writes every public field, nested dataclasses as ``_target_`` mappings; ``to_yaml`` writes that dict
with ``yaml.safe_dump`` (functions, enums, dtypes and partials as ``_target_`` references, see ``yaml_utils``).
``from_dict``/``from_yaml`` build the container back through ``instantiate``, so every ``_target_`` must pass the
allow-list in ``instantiate_utils``.
"""

import copy
import os
import re
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from dataclasses import is_dataclass
from typing import Any, Type, TypeVar

import yaml

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.training.config.common_config import DistributedInitConfig, ProfilingConfig, RNGConfig
from megatron.training.config.inference_config import InferenceSetupConfig
from megatron.training.config.instantiate_utils import InstantiationMode, instantiate
from megatron.training.config.resilience_config import RerunStateMachineConfig, StragglerDetectionConfig
from megatron.training.config.training_config import (
    CheckpointConfig,
    LoggerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron.training.config.utils import sanitize_dataclass_config
from megatron.training.config.yaml_utils import safe_yaml_representers
from megatron.training.models import Serializable

T = TypeVar("T", bound="ConfigContainerBase")

_INTERPOLATION = "${"
# One reference: ${...} holding no further braces or dollar signs.
_REFERENCE = re.compile(r"\$\{([^${}]*)\}")


def _check_local_path(path: str) -> None:
    """Object-store (``msc://``) paths are not supported: this project reads and writes local files only."""
    if path.startswith("msc://"):
        raise ValueError(
            f"{path}: msc:// object-store paths are not supported by megatron-lite; "
            "copy the file to a local or mounted file system and pass that path"
        )


class _Interpolator:
    """Resolves OmegaConf-style ``${...}`` references in a plain config tree, for when omegaconf is not installed.

    Supported: ``${a.b.0}`` (a path from the top of the file; list items by index) and ``${oc.env:VAR}`` /
    ``${oc.env:VAR,default}`` (``null`` as the default gives None). A string that is a single reference takes the
    referenced value with its type; references inside a longer string are replaced by the value's text. Anything
    else (other resolvers, relative or nested references, a reference loop) is refused, naming the key.
    """

    def __init__(self, root: Any, yaml_path: str):
        self.root, self.yaml_path = root, yaml_path

    def _fail(self, key: str, problem: str) -> ValueError:
        return ValueError(f"{self.yaml_path}: key '{key}': {problem}")

    def resolve(self, value: Any, key: str = "", active: tuple = ()) -> Any:
        if isinstance(value, dict):
            return {k: self.resolve(v, f"{key}.{k}" if key else str(k), active) for k, v in value.items()}
        if isinstance(value, list):
            return [self.resolve(v, f"{key}.{i}" if key else str(i), active) for i, v in enumerate(value)]
        if not isinstance(value, str) or _INTERPOLATION not in value:
            return value
        whole = _REFERENCE.fullmatch(value)
        if whole:
            return self._lookup(whole.group(1).strip(), key, active)
        text = _REFERENCE.sub(lambda m: str(self._lookup(m.group(1).strip(), key, active)), value)
        if _INTERPOLATION in text:
            raise self._fail(key, f"cannot resolve '{value}' (nested references are not supported without omegaconf)")
        return text

    def _lookup(self, expression: str, key: str, active: tuple) -> Any:
        if expression.startswith("oc.env:"):
            name, has_default, default = expression[len("oc.env:") :].partition(",")
            if name.strip() in os.environ:
                return os.environ[name.strip()]
            if has_default:
                default = default.strip().strip("'\"")
                return None if default == "null" else default
            raise self._fail(
                key, f"environment variable '{name.strip()}' is not set and '${{{expression}}}' has no default"
            )
        if not expression or ":" in expression or expression.startswith("."):
            raise self._fail(
                key,
                f"'${{{expression}}}' is not supported without omegaconf (only ${{a.b}} and ${{oc.env:VAR}}): "
                "pip install omegaconf, or write the value out",
            )
        if expression in active:
            raise self._fail(key, f"'${{{expression}}}' refers back to itself")
        node = self.root
        for part in expression.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self._fail(key, f"'${{{expression}}}' refers to a key that is not in the file")
        return self.resolve(node, expression, active + (expression,))


def _resolve_interpolations(config: Any, yaml_path: str) -> Any:
    """``config`` with its ``${...}`` references resolved: by OmegaConf when it is installed (as Megatron does),
    else by ``_Interpolator``."""
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return _Interpolator(config, yaml_path).resolve(config)
    return OmegaConf.to_container(OmegaConf.create(config), resolve=True)


@dataclass(kw_only=True)
class ConfigContainerBase:
    """Base class of the config containers: conversion to and from dicts and YAML files."""

    @classmethod
    def from_dict(cls: Type[T], config_dict: dict[str, Any], mode: InstantiationMode = InstantiationMode.STRICT) -> T:
        """Build the container ``config_dict`` (as written by ``to_dict``) describes.

        The dict must have a ``_target_``. Keys that are not fields of this class are an error in STRICT mode
        and dropped in LENIENT mode; fields computed in ``__post_init__`` (``init=False``) saved by older writers
        are dropped. ``config_dict`` itself is not changed.
        """
        if not isinstance(config_dict, dict):
            raise TypeError(
                f"{cls.__qualname__}.from_dict needs a dict with a '_target_' key, got {type(config_dict).__name__}"
            )
        if "_target_" not in config_dict:
            raise AssertionError(
                f"{cls.__qualname__}.from_dict: the dict has no '_target_' key; add "
                f"'_target_: {cls.__module__}.{cls.__qualname__}' (to_dict writes it)"
            )
        config_dict = sanitize_dataclass_config(copy.deepcopy(config_dict))

        expected = {f.name for f in dataclass_fields(cls) if not f.name.startswith("_")} | {"_target_"}
        extra = set(config_dict) - expected
        if extra and mode == InstantiationMode.STRICT:
            raise ValueError(
                f"Dictionary contains extra keys not in {cls.__qualname__}: {sorted(extra)}; "
                f"its fields are {sorted(expected - {'_target_'})} (use InstantiationMode.LENIENT to drop them)"
            )
        for key in extra:
            config_dict.pop(key)
        built = instantiate(config_dict, mode=mode)
        if not isinstance(built, cls):
            raise TypeError(
                f"{cls.__qualname__}.from_dict: '_target_: {config_dict['_target_']}' built a "
                f"{type(built).__qualname__}, not a {cls.__qualname__}; is this the right file?"
            )
        return built

    @classmethod
    def from_yaml(cls: Type[T], yaml_path: str, mode: InstantiationMode = InstantiationMode.LENIENT) -> T:
        """Build the container from a YAML file written by ``to_yaml`` (or by hand in the same layout)."""
        _check_local_path(yaml_path)
        if not os.path.exists(yaml_path):
            raise FileNotFoundError(f"YAML file not found: {yaml_path}")
        with open(yaml_path, "r") as f:
            config_dict = yaml.safe_load(f)
        if not isinstance(config_dict, dict):
            raise ValueError(
                f"{yaml_path}: the file must hold a mapping with a '_target_' key, not {type(config_dict).__name__}"
            )
        return cls.from_dict(_resolve_interpolations(config_dict, yaml_path), mode=mode)

    def to_dict(self) -> dict[str, Any]:
        """This container as a dict: ``_target_`` (its class) and every public field, nested values converted by
        ``_convert_value_to_dict``."""
        result = {"_target_": f"{self.__class__.__module__}.{self.__class__.__qualname__}"}
        for f in dataclass_fields(self):
            if not f.name.startswith("_"):
                result[f.name] = self._convert_value_to_dict(getattr(self, f.name))
        return result

    @classmethod
    def _convert_value_to_dict(cls, value: Any) -> Any:
        """A field value in dict form: containers via ``to_dict``, ``Serializable`` objects via ``as_dict``,
        objects with ``to_cfg_dict`` via that, other dataclasses as ``_target_`` mappings of their public fields,
        lists/tuples and dicts element by element; anything else (numbers, strings, callables) unchanged."""
        if isinstance(value, ConfigContainerBase):
            return value.to_dict()
        if isinstance(value, Serializable):
            return value.as_dict()
        if hasattr(value, "to_cfg_dict"):
            return value.to_cfg_dict()
        if is_dataclass(value) and not isinstance(value, type):
            result = {"_target_": f"{value.__class__.__module__}.{value.__class__.__qualname__}"}
            for f in dataclass_fields(value):
                if not f.name.startswith("_"):
                    result[f.name] = cls._convert_value_to_dict(getattr(value, f.name))
            return result
        if isinstance(value, (list, tuple)):
            return [cls._convert_value_to_dict(item) for item in value]
        if isinstance(value, dict):
            return {key: cls._convert_value_to_dict(item) for key, item in value.items()}
        return value

    def to_yaml(self, yaml_path: str) -> None:
        """Write ``to_dict()`` to ``yaml_path`` as YAML."""
        _check_local_path(yaml_path)
        config_dict = self.to_dict()
        with safe_yaml_representers(), open(yaml_path, "w") as f:
            yaml.safe_dump(config_dict, f, default_flow_style=False)

    def print_yaml(self) -> None:
        """Print ``to_dict()`` as YAML."""
        config_dict = self.to_dict()
        with safe_yaml_representers():
            print(yaml.safe_dump(config_dict, default_flow_style=False))

    def __deepcopy__(self, memo):
        # Copies the fields without calling __init__, so __post_init__ does not run again on the copy.
        result = self.__class__.__new__(self.__class__)
        memo[id(self)] = result
        for f in dataclass_fields(self):
            setattr(result, f.name, copy.deepcopy(getattr(self, f.name), memo))
        return result


@dataclass(kw_only=True)
class PretrainConfigContainer(ConfigContainerBase):
    """Everything a pretraining run is configured by, one config dataclass per concern.

    ``train``, ``model``, ``optimizer``, ``scheduler``, ``logger`` and ``checkpoint`` must be given; the rest
    have defaults. ``model`` is a ``GPTModelConfig``/``HybridModelConfig`` (``megatron.training.models``: model
    config plus builder); any other config object is accepted and written as it is.
    """

    train: TrainingConfig
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    model: Any
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    logger: LoggerConfig
    checkpoint: CheckpointConfig
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    straggler: StragglerDetectionConfig | None = None


@dataclass(kw_only=True)
class InferenceConfigContainer(ConfigContainerBase):
    """What an inference entry point is configured by: the model to load, the checkpoint to load it from, and
    ``inference`` (whose ``to_inference_config`` builds the engine's runtime config once the model exists).

    Unlike ``PretrainConfigContainer`` it has no training loop, optimizer, schedule, DDP, rerun-machine or
    straggler settings. ``model`` is typed loosely for the same reason as there.
    """

    model: Any
    checkpoint: CheckpointConfig
    inference: InferenceSetupConfig
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
