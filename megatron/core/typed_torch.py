"""Typing helpers: keep static types through ``nn.Module`` calls and forwarding wrappers.

Megatron-Core 0.19 names: ``apply_module`` (a module, typed as its ``forward``), ``not_none`` (narrow an Optional)
and ``copy_signature`` (give a ``*args, **kwargs`` wrapper the signature of what it forwards to, so ``inspect`` and
IDEs show the real parameters).
"""

import inspect
from typing import Any, Callable, Literal, Optional, TypeVar

import torch

T = TypeVar("T")


def apply_module(m: torch.nn.Module, *, check_subclass: bool = True) -> Callable[..., Any]:
    """``m`` itself, for type checkers a callable with its ``forward``'s signature."""
    if check_subclass and not isinstance(m, torch.nn.Module):
        raise TypeError(f"{type(m)} is not a subclass of torch.nn.Module")
    return m


def not_none(value: Optional[T]) -> T:
    """``value``; a ValueError if it is None."""
    if value is None:
        raise ValueError("Expected value to be not None")
    return value


def copy_signature(
    source: Callable[..., Any],
    /,
    *,
    handle_return_type: Literal["preserve", "overwrite"] = "preserve",
    handle_first_src_param: Literal["copy", "skip"] = "copy",
    handle_first_dst_param: Literal["preserve", "drop"] = "drop",
):
    """A decorator setting the decorated callable's ``__signature__`` to ``source``'s parameters.

    ``handle_return_type='overwrite'`` also takes ``source``'s return annotation (else the decorated one's stays);
    ``handle_first_src_param='skip'`` leaves out ``source``'s first parameter (its ``self``/``cls``);
    ``handle_first_dst_param='preserve'`` keeps the decorated callable's own first parameter in front.
    """
    choices = {
        "handle_return_type": (handle_return_type, ("preserve", "overwrite")),
        "handle_first_src_param": (handle_first_src_param, ("copy", "skip")),
        "handle_first_dst_param": (handle_first_dst_param, ("preserve", "drop")),
    }
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"copy_signature: {name} must be one of {allowed}, got {value!r}")
    source_signature = inspect.signature(source)
    source_params = list(source_signature.parameters.values())
    if handle_first_src_param == "skip":
        source_params = source_params[1:]

    def decorator(decorated: Callable[..., Any], /) -> Callable[..., Any]:
        own = inspect.signature(decorated)
        kept = list(own.parameters.values())[:1] if handle_first_dst_param == "preserve" else []
        signature = own.replace(parameters=kept + source_params)
        if handle_return_type == "overwrite":
            signature = signature.replace(return_annotation=source_signature.return_annotation)
        decorated.__signature__ = signature
        return decorated

    return decorator
