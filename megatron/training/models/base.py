"""Model configs and their builders (Megatron-LM 0.19's ``megatron.training.models``): the protocol shared with the
config containers, the ``ModelConfig`` base class, the ``ModelBuilder`` interface and ``compose_hooks``.

A ``ModelConfig`` is data only: the model's settings (usually a ``TransformerConfig`` plus model fields) and the
dotted path of the ``ModelBuilder`` that turns it into model chunks. ``as_dict``/``from_dict`` write and read it as
a ``_target_`` dict, so it can travel inside a ``PretrainConfigContainer`` and its YAML file.
"""

import abc
import importlib
import logging
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module, MegatronModule

logger = logging.getLogger(__name__)

# Fields holding functions: not data, so never written by as_dict.
_HOOK_FIELDS = ("pre_wrap_hooks", "post_wrap_hooks")


@runtime_checkable
class Serializable(Protocol):
    """An object that writes itself as a ``_target_`` dict (``as_dict``) and reads itself back (``from_dict``).
    ``ConfigContainerBase.to_dict`` uses ``as_dict`` for any value that has both methods."""

    def as_dict(self) -> dict[str, Any]:
        """This object as a dict whose ``_target_`` names its class."""
        ...

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Serializable":
        """The object ``data`` (as written by ``as_dict``) describes."""
        ...


def _resolve_target(target: str) -> type:
    """The dataclass named by ``target``. A module is imported only when the ``_target_`` allow-list admits it;
    a class of a module already imported (a config defined by the running program) needs no import."""
    # Imported here: megatron.training.config's containers import this package.
    from megatron.training.config.instantiate_utils import target_allowlist

    module_path, _, class_name = target.rpartition(".")
    if not module_path:
        raise ValueError(f"_target_ {target!r} is not a dotted path 'package.module.Class'")
    if module_path not in sys.modules and not target_allowlist.is_allowed(target):
        raise ValueError(
            f"_target_ {target!r} is not allowed: its module is not imported and not in the allow-list; "
            f"import it first or call megatron.training.config.target_allowlist.add_prefix('{module_path}.')"
        )
    config_class = getattr(importlib.import_module(module_path), class_name, None)
    if not (isinstance(config_class, type) and is_dataclass(config_class)):
        raise ValueError(f"_target_ {target!r} does not name a dataclass")
    return config_class


def _config_as_dict(config) -> dict[str, Any]:
    result = {"_target_": f"{type(config).__module__}.{type(config).__qualname__}"}
    for config_field in fields(config):
        value = getattr(config, config_field.name)
        if callable(value) or config_field.name.startswith("_") or config_field.name in _HOOK_FIELDS:
            continue
        result[config_field.name] = _config_as_dict(value) if is_dataclass(value) else value
    return result


def _config_from_dict(data: dict[str, Any]):
    if "_target_" not in data:
        raise ValueError(f"cannot read a config from a dict without '_target_' (keys: {sorted(data)})")
    config_class = _resolve_target(data["_target_"])
    known = {config_field.name for config_field in fields(config_class)}
    kwargs = {}
    for key, value in data.items():
        if key in known and not key.startswith("_"):  # keys of another version of the class are left out
            kwargs[key] = _config_from_dict(value) if isinstance(value, dict) and "_target_" in value else value
    return config_class(**kwargs)


@dataclass
class ModelConfig:
    """Base class of model configs (``GPTModelConfig``, ``HybridModelConfig``, ...): data only, no building.

    A subclass sets ``builder``, the dotted path of its ``ModelBuilder`` class. ``as_dict`` writes every field that
    is not a function, not private and not a hook list (nested dataclasses as ``_target_`` dicts) plus
    ``_builder_``; ``from_dict`` reads such a dict back, ignoring keys the class does not have.
    """

    builder: ClassVar[str]
    """Dotted path of the ``ModelBuilder`` class that builds this config."""

    restore_modelopt_state: bool = False
    """Restore ModelOpt quantization/sparsity state (ModelOpt is not supported by megatron-lite)."""

    extra_checkpoint_metadata: dict[str, Any] | None = None
    """More model metadata to save in the checkpoint; must be serializable."""

    pre_wrap_hooks: list[Callable[[list[MegatronModule]], list[MegatronModule]]] = field(default_factory=list)
    """Functions run, in order, on the list of model chunks before the DDP/FSDP wrapper; each returns the list."""

    post_wrap_hooks: list[Callable[[list[MegatronModule]], list[MegatronModule]]] = field(default_factory=list)
    """Functions run, in order, on the list of model chunks once they are built and wrapped."""

    def get_builder_cls(self) -> type:
        """The builder class named by ``builder``."""
        module_path, _, class_name = self.builder.rpartition(".")
        return getattr(importlib.import_module(module_path), class_name)

    def as_dict(self) -> dict[str, Any]:
        """This config as a ``_target_`` dict with its ``_builder_`` path."""
        result = _config_as_dict(self)
        result["_builder_"] = self.builder
        return result

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """The config ``data`` describes (its ``_target_`` class, whatever ``cls`` is), ``builder`` from
        ``_builder_`` when given."""
        result = _config_from_dict(data)
        if "_builder_" in data:
            result.builder = data["_builder_"]
        return result


class ModelConfigError(ValueError, AssertionError):
    """A model config that cannot be built. A ValueError, and an AssertionError because Megatron-LM checks these
    with ``assert``: code catching either keeps working."""


def not_supported(feature: str, setting: str) -> ValueError:
    """The error for a model-building feature megatron-lite does not have, naming the setting that asks for it."""
    return ValueError(f"not supported yet: {feature} ({setting}); leave it unset to build megatron-lite's own layers")


class TransformerProxyMixin:
    """Reads and writes of names a model config does not have go to its ``transformer`` (a TransformerConfig):
    ``config.hidden_size`` is ``config.transformer.hidden_size``; the config's own fields stay its own."""

    def __getattr__(self, name: str, /) -> Any:
        # Only called once normal lookup failed; object.__getattribute__ avoids recursing into here.
        try:
            transformer = object.__getattribute__(self, "transformer")
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__} has no attribute '{name}' (it has no transformer yet)"
            ) from None
        if hasattr(transformer, name):
            return getattr(transformer, name)
        raise AttributeError(f"Neither {type(self).__name__} nor TransformerConfig has any attribute '{name}'")

    def __setattr__(self, name: str, value: Any, /) -> None:
        try:
            transformer = object.__getattribute__(self, "transformer")
        except AttributeError:  # during __init__, before ``transformer`` is set
            object.__setattr__(self, name, value)
            return
        if hasattr(transformer, name) and name not in type(self).__dataclass_fields__:
            setattr(transformer, name, value)
        else:
            object.__setattr__(self, name, value)

    def _padded_vocab_size(self, calculate: Callable[[int, int, int], int]) -> int:
        """``vocab_size`` padded by ``calculate`` when ``should_pad_vocab``, else as given."""
        if self.vocab_size is None:
            raise ModelConfigError(
                f"{type(self).__name__}.vocab_size must be configured before calling build_model() "
                "(the tokenizer's vocabulary size, or the padded size with should_pad_vocab=False)"
            )
        if not self.should_pad_vocab:
            return self.vocab_size
        return calculate(
            self.vocab_size, self.make_vocab_size_divisible_by, self.transformer.tensor_model_parallel_size
        )


def apply_post_wrap_hooks(hooks, compose, model_list: list) -> list:
    """``model_list`` through the composed post-wrap hooks; a hook chain returning None keeps the list."""
    result = compose(hooks)(model_list)
    if result is None:
        logger.warning("The post-wrap hooks returned None; keeping the model chunks they were given.")
        return model_list
    return result


ModelT = TypeVar("ModelT", bound=MegatronModule)
BuildConfigT = TypeVar("BuildConfigT", bound=ModelConfig)


class ModelBuilder(abc.ABC, Generic[ModelT, BuildConfigT]):
    """Turns a ``ModelConfig`` into models: one pipeline stage (``build_model``) or this rank's stages wrapped for
    distributed training (``build_distributed_models``, a list even without virtual pipelining). A builder keeps
    the config it was given and changes nothing else, so it can build many times."""

    def __init__(self, model_config: ModelConfig):
        self._model_config = model_config

    @abc.abstractmethod
    def build_model(
        self,
        pg_collection: ProcessGroupCollection,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        vp_stage: int | None = None,
    ) -> ModelT:
        """One model stage; ``pre_process`` (embedding) and ``post_process`` (output layer) default to what the
        stage's place in the (virtual) pipeline implies."""

    @abc.abstractmethod
    def build_distributed_models(
        self,
        pg_collection: ProcessGroupCollection,
        ddp_config: DistributedDataParallelConfig | None = None,
        overlap_param_gather_with_optimizer_step: bool = False,
        use_megatron_fsdp: bool = False,
        use_torch_fsdp2: bool = False,
        wrap_with_ddp: bool = True,
        data_parallel_random_init: bool = False,
        mixed_precision_wrapper: Callable[[Any, MegatronModule], MegatronModule] | None = Float16Module,
        model_type: ModelType = ModelType.encoder_or_decoder,
    ) -> list[ModelT]:
        """This rank's model stages, hooks applied and wrapped for distributed training."""


def compose_hooks(
    hooks: list[Callable[[list[MegatronModule]], list[MegatronModule]]],
) -> Callable[[list[MegatronModule]], list[MegatronModule]]:
    """One function running ``hooks`` in order, each on the previous one's result (no hooks: the identity)."""

    def composed_hook(model: list[MegatronModule]) -> list[MegatronModule]:
        for hook in hooks:
            model = hook(model)
        return model

    return composed_hook
