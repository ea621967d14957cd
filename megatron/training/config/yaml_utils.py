"""Writing configs that hold functions, classes, enums, partials and dtypes with ``yaml.safe_dump``.

Inside ``safe_yaml_representers()`` the SafeDumper writes each such value as a ``_target_`` mapping that
``instantiate`` can turn back into the value (``_call_: false`` for a function, class or dtype; ``_partial_`` for a
partial; ``_args_`` with the value for an enum member). Any other object is written as its class with
``_call_: true``. The dumper's original representers are restored on leaving, so the global SafeDumper is not
changed for other code.
"""

import enum
import functools
from contextlib import contextmanager
from typing import Generator

import yaml


def _dotted_name(obj) -> str:
    """``module.QualifiedName`` of a function or class (AttributeError for an object without a qualified name)."""
    return f"{obj.__module__}.{obj.__qualname__}"


def _register_optional_representers() -> None:
    """Representers for torch dtypes and Hugging Face configs, where those packages are installed."""
    try:
        import torch

        yaml.SafeDumper.add_representer(torch.dtype, _torch_dtype_representer)
    except ModuleNotFoundError:
        pass
    try:
        from transformers import GenerationConfig, PretrainedConfig
    except ModuleNotFoundError:
        return
    yaml.SafeDumper.add_representer(GenerationConfig, _generation_config_representer)
    # A multi-representer, so every model config class (a PretrainedConfig subclass) is covered.
    yaml.SafeDumper.add_multi_representer(PretrainedConfig, _pretrained_config_representer)


@contextmanager
def safe_yaml_representers() -> Generator[None, None, None]:
    """Within the block, ``yaml.safe_dump`` writes functions, classes, partials, enums, dtypes and other objects
    as ``_target_`` mappings; afterwards the SafeDumper's representers are as they were."""
    saved = yaml.SafeDumper.yaml_representers.copy()
    saved_multi = yaml.SafeDumper.yaml_multi_representers.copy()
    try:
        yaml.SafeDumper.add_representer(functools.partial, _partial_representer)
        yaml.SafeDumper.add_multi_representer(enum.Enum, _enum_representer)
        yaml.SafeDumper.add_representer(type(lambda: None), _function_representer)
        yaml.SafeDumper.add_representer(type, _function_representer)
        _register_optional_representers()
        # The fallback for everything else; exact representers above take precedence over it.
        yaml.SafeDumper.add_multi_representer(object, _safe_object_representer)
        yield
    finally:
        yaml.SafeDumper.yaml_representers = saved
        yaml.SafeDumper.yaml_multi_representers = saved_multi


def _function_representer(dumper, data):
    """A function or class, as a reference to itself (``_call_: false``)."""
    return dumper.represent_data({"_target_": _dotted_name(data), "_call_": False})


def _torch_dtype_representer(dumper, data):
    """A torch dtype (``torch.bfloat16``), as a reference to itself."""
    return dumper.represent_data({"_target_": str(data), "_call_": False})


def _safe_object_representer(dumper, data):
    """Any other object: a reference to it when it has a qualified name (functions, builtins), otherwise its
    class with ``_call_: true`` (rebuilt by calling the class with no arguments)."""
    try:
        value = {"_target_": _dotted_name(data), "_call_": False}
    except AttributeError:
        value = {"_target_": _dotted_name(data.__class__), "_call_": True}
    return dumper.represent_data(value)


def _partial_representer(dumper, data):
    """``functools.partial(f, *args, **kw)`` as ``f`` with ``_partial_: true``, ``_args_`` and the keywords."""
    value = {"_target_": _dotted_name(data.func), "_partial_": True, "_args_": list(data.args)}
    value.update(data.keywords)
    return dumper.represent_data(value)


def _enum_representer(dumper, data):
    """An enum member as a call of its class with its value (``_name_`` kept for readers)."""
    value = {"_target_": _dotted_name(data.__class__), "_call_": True, "_args_": [data.value], "_name_": data.name}
    return dumper.represent_data(value)


def _hf_config_value(data) -> dict:
    cls = data.__class__
    return {"_target_": f"{_dotted_name(cls)}.from_dict", "_call_": True, "config_dict": data.to_dict()}


def _generation_config_representer(dumper, data):
    """A ``transformers.GenerationConfig`` as a ``from_dict`` call with its fields."""
    return dumper.represent_data(_hf_config_value(data))


def _pretrained_config_representer(dumper, data):
    """A ``transformers.PretrainedConfig`` (any model config) as a ``from_dict`` call with all its fields."""
    return dumper.represent_data(_hf_config_value(data))
