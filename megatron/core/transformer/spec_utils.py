"""ModuleSpec and build_module: layer recipes that swap implementations without touching model code."""

import collections.abc
import functools
import importlib
import types
import typing
from dataclasses import dataclass, field
from typing import Tuple, Union


@dataclass
class ModuleSpec:
    """What to build: ``module`` (a class, function, or ``(module_path, name)`` to import), the keyword ``params``
    to pass it, and its own ``submodules`` (a dataclass of further specs), passed as ``submodules=`` when set.

    ``metainfo`` describes the spec to whoever assembles it and is never passed to the module; e.g. an attention
    spec whose projection fuses the input norm says ``{"fuse_input_layernorm": True}`` so the layer spec leaves its
    separate input norm out.
    """

    module: Union[Tuple, type]
    params: dict = field(default_factory=lambda: {})
    submodules: object = None
    metainfo: dict = field(default_factory=lambda: {})

    def __call__(self, *args, **kwargs):
        """A spec is a builder too: calling it builds its module (:func:`build_module`)."""
        return build_module(self, *args, **kwargs)


def import_module(module_path: Tuple[str, str]):
    """Import ``name`` from ``module_path`` given as ``(module_path, name)``."""
    base_path, name = module_path
    return getattr(importlib.import_module(base_path), name)


def get_module(spec_or_module: Union[ModuleSpec, type], **additional_kwargs):
    """The class or function a spec names, without building it."""
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    if isinstance(spec_or_module.module, (type, types.FunctionType)):
        return spec_or_module.module
    return import_module(spec_or_module.module)


def get_submodules(spec: collections.abc.Callable[..., typing.Any]) -> object:
    """The ``submodules`` a spec will pass: a ModuleSpec's field (or any object's ``submodules`` attribute), or the
    ``submodules`` keyword bound in a ``functools.partial``. As in Megatron, a partial that binds no ``submodules``
    is a ``KeyError`` and any other spec without them a ``ValueError``."""
    if isinstance(spec, functools.partial):
        if "submodules" not in spec.keywords:
            raise KeyError(f"the partial spec {spec!r} binds no submodules= keyword")
        return spec.keywords["submodules"]
    if hasattr(spec, "submodules"):
        return spec.submodules
    raise ValueError(f"the spec {spec!r} has no submodules")


def build_module(spec_or_module: Union[ModuleSpec, type], *args, **kwargs):
    """Instantiate what ``spec_or_module`` describes.

    A bare function (such as ``get_bias_dropout_add``) is returned as it is; a class is called with ``args`` and
    ``kwargs``; a :class:`ModuleSpec` is called with ``args``, its ``params`` and ``kwargs`` (``kwargs`` win), plus
    ``submodules`` when the spec has them. Any other callable (a builder such as
    ``functools.partial(MLP.as_mlp_submodule, submodules=...)``) is called with ``args`` and ``kwargs``.
    """
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    if isinstance(spec_or_module, ModuleSpec) and isinstance(spec_or_module.module, types.FunctionType):
        return spec_or_module.module
    if isinstance(spec_or_module, type) or (callable(spec_or_module) and not isinstance(spec_or_module, ModuleSpec)):
        return spec_or_module(*args, **kwargs)
    module = get_module(spec_or_module)
    params = {**spec_or_module.params, **kwargs}
    if spec_or_module.submodules is not None:
        params["submodules"] = spec_or_module.submodules
    try:
        return module(*args, **params)
    except TypeError as error:
        raise TypeError(f"could not build {module.__qualname__} from its ModuleSpec: {error}") from error
