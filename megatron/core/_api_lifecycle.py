"""Megatron-Core's API life-cycle decorators (public at ``megatron.core.utils``): experimental APIs that need
``megatron.core.config.set_experimental_flag(True)``, internal and deprecated ones."""

import functools
import inspect
import warnings
from typing import Any, Callable, Optional, TypeVar

from megatron.core.public_api import public_api

_Wrapped = TypeVar("_Wrapped", bound=Callable[..., Any])


@public_api("megatron.core.utils")
class ExperimentalNotEnabledError(Exception):
    """An experimental API was called without ``megatron.core.config.set_experimental_flag(True)``."""


def _check_experimental(name: str, introduced_with_version: Optional[str]) -> None:
    from megatron.core import config

    if not config.is_experimental_enabled():
        since = f" (introduced with {introduced_with_version})" if introduced_with_version else ""
        raise ExperimentalNotEnabledError(
            f"{name} is experimental{since} and not enabled; call "
            "megatron.core.config.set_experimental_flag(True) to use it"
        )


@public_api("megatron.core.utils")
def experimental_fn(introduced_with_version: str):
    """Decorator: calling the function raises ExperimentalNotEnabledError unless experimental APIs are enabled."""

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            _check_experimental(func.__qualname__, introduced_with_version)
            return func(*args, **kwargs)

        wrapper._experimental_api = True
        return wrapper

    return decorate


@public_api("megatron.core.utils")
def experimental_cls(introduced_with_version: str):
    """Class decorator: instantiating the class, or reading any attribute of it or of its instances, raises
    ExperimentalNotEnabledError unless experimental APIs are enabled; ``is_experimental`` always answers whether they
    are (as on Megatron-Core)."""

    def guarded(cls_name, read, attr):
        from megatron.core import config

        if attr == "is_experimental":
            return config.is_experimental_enabled()
        _check_experimental(cls_name, introduced_with_version)
        return read(attr)

    def decorate(cls):
        cls_name = cls.__qualname__
        original_init = cls.__init__

        def __init__(self, *args, **kwargs):
            _check_experimental(cls_name, introduced_with_version)
            original_init(self, *args, **kwargs)

        def instance_getattribute(self, attr):
            return guarded(cls_name, lambda name: super(guarded_cls, self).__getattribute__(name), attr)

        def class_getattribute(klass, attr):
            return guarded(cls_name, lambda name: type.__getattribute__(klass, name), attr)

        # The metaclass carries the class's own name, so ``type(A).__qualname__`` reads "A" as on Megatron-Core.
        meta = type(cls.__name__, (type(cls),), {"__getattribute__": class_getattribute, "__qualname__": cls_name})
        namespace = {
            "__init__": functools.wraps(original_init)(__init__),
            "__getattribute__": instance_getattribute,
            "__qualname__": cls_name,
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
            "_experimental_api": True,
        }
        guarded_cls = meta(cls.__name__, (cls,), namespace)
        return guarded_cls

    return decorate


@public_api("megatron.core.utils")
def experimental_api(func: _Wrapped) -> _Wrapped:
    """Mark a function or class as experimental (see :func:`experimental_fn` / :func:`experimental_cls`)."""
    if inspect.isclass(func):
        return experimental_cls(None)(func)
    return experimental_fn(None)(func)


@public_api("megatron.core.utils")
def internal_api(func: _Wrapped) -> _Wrapped:
    """Mark ``func`` as internal: no behaviour change, but API-compatibility checks skip it."""
    func._internal_api = True
    return func


@public_api("megatron.core.utils")
def deprecated(
    version: str, removal_version: Optional[str] = None, alternative: Optional[str] = None, reason: Optional[str] = None
) -> Callable[[_Wrapped], _Wrapped]:
    """Decorator: each call warns (DeprecationWarning) that the function or class is deprecated since ``version``."""

    def decorate(func):
        message = f"{func.__qualname__} is deprecated since version {version}"
        if removal_version:
            message += f" and will be removed in version {removal_version}"
        if alternative:
            message += f"; use {alternative} instead"
        if reason:
            message += f" ({reason})"

        if inspect.isclass(func):
            original_init = func.__init__

            @functools.wraps(original_init)
            def __init__(self, *args, **kwargs):
                warnings.warn(message, DeprecationWarning, stacklevel=2)
                original_init(self, *args, **kwargs)

            func.__init__ = __init__
            func._deprecated = True
            return func

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return func(*args, **kwargs)

        wrapper._deprecated = True
        return wrapper

    return decorate


@public_api("megatron.core.utils")
def deprecate_args(
    *deprecated_keys: str, message: str = "Argument '{name}' has been deprecated and should not be used."
) -> Callable[[_Wrapped], _Wrapped]:
    """Decorator: warn (DeprecationWarning) when any of ``deprecated_keys`` is passed as a keyword argument."""

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            for name in deprecated_keys:
                if name in kwargs:
                    warnings.warn(message.format(name=name), DeprecationWarning, stacklevel=2)
            return func(*args, **kwargs)

        return wrapper

    return decorate


@public_api("megatron.core.utils")
def null_decorator(*args, **kwargs):
    """A decorator that changes nothing, usable bare (``@null_decorator``) or with arguments
    (``@null_decorator(x)``)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda func: func
