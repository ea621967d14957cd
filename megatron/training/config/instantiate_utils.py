"""Building objects from ``_target_`` configs (plain dicts and lists, as read from YAML), behind an allow-list.

A node that is a mapping with a ``_target_`` key names a class or function by its dotted path; the other keys are
its keyword arguments, built first (depth first). Four more special keys steer the call:

- ``_args_``: positional arguments (a list);
- ``_partial_: true``: return ``functools.partial(target, ...)`` instead of calling it;
- ``_call_: false``: return the target itself (a class, function or dtype) without calling it;
- ``_name_``: informational (an enum member's name, written by the YAML representers); never passed on.

Because a config file may come from anywhere, a string ``_target_`` is checked against ``target_allowlist``
before anything is imported: by default only ``megatron.training.``, ``megatron.core.``, ``torch.``,
``transformers.`` and ``signal.`` paths, plus ``functools.partial``. Anything else is refused with an
``InstantiationException`` that says how to allow it.

This is a dependency-free rebuild of Megatron's OmegaConf-based version: configs are plain Python containers.
An OmegaConf ``DictConfig``/``ListConfig`` is accepted when omegaconf is installed (it is converted to plain
containers, interpolations resolved, first).
"""

import functools
import importlib
import inspect
import logging
import types
from enum import Enum
from typing import Any, Callable

logger = logging.getLogger(__name__)


class InstantiationException(Exception):
    """A config node could not be turned into an object (refused, unknown or failing target, bad special key)."""


class InstantiationMode(Enum):
    """How config keys that the target does not accept are treated: STRICT raises, LENIENT drops them with a
    warning."""

    STRICT = "strict"
    LENIENT = "lenient"


class _Keys(str, Enum):
    """The reserved keys of a config node."""

    TARGET = "_target_"
    PARTIAL = "_partial_"
    CALL = "_call_"
    ARGS = "_args_"
    NAME = "_name_"


_DEFAULT_ALLOWED_PREFIXES = ("megatron.training.", "megatron.core.", "torch.", "transformers.", "signal.")
_DEFAULT_ALLOWED_EXACT = frozenset({"functools.partial"})
_MISSING = "???"
# Keys never passed to a target as keyword arguments (``_args_`` is collected separately).
_RESERVED = frozenset({_Keys.TARGET.value, _Keys.PARTIAL.value, _Keys.CALL.value, _Keys.NAME.value})


class TargetAllowlist:
    """The dotted paths a string ``_target_`` may name: module prefixes (each ending in ``.``, so ``torch.``
    does not admit ``torchvision``) and exact paths. Checked before any import, so a refused config runs no code.
    """

    def __init__(self) -> None:
        self._allowed_prefixes = list(_DEFAULT_ALLOWED_PREFIXES)
        self._allowed_exact = set(_DEFAULT_ALLOWED_EXACT)
        self._enabled = True

    def is_allowed(self, target: str) -> bool:
        """True when ``target`` may be imported and called (always, while the list is disabled)."""
        if not self._enabled:
            return True
        if target in self._allowed_exact:
            return True
        return any(target.startswith(prefix) for prefix in self._allowed_prefixes)

    def add_prefix(self, prefix: str) -> None:
        """Admit every path under ``prefix`` (which must end with ``.``); adding it twice is harmless."""
        if not prefix.endswith("."):
            raise ValueError(
                f"Prefix must end with '.': got '{prefix}'; write '{prefix}.' so that only that package matches"
            )
        if prefix not in self._allowed_prefixes:
            self._allowed_prefixes.append(prefix)

    def remove_prefix(self, prefix: str) -> None:
        """Stop admitting ``prefix``; a ValueError when it is not in the list."""
        if prefix not in self._allowed_prefixes:
            raise ValueError(f"Prefix '{prefix}' is not in the allowlist; allowed prefixes: {self._allowed_prefixes}")
        self._allowed_prefixes.remove(prefix)

    def add_exact(self, target: str) -> None:
        """Admit exactly the dotted path ``target``."""
        self._allowed_exact.add(target)

    def remove_exact(self, target: str) -> None:
        """Stop admitting ``target``; nothing happens when it was not admitted."""
        self._allowed_exact.discard(target)

    def disable(self) -> None:
        """Admit every target. Only for configs you wrote yourself: a disabled list lets a config run any code."""
        logger.warning("The _target_ allowlist is disabled: configs may now import and call any target.")
        self._enabled = False

    def enable(self) -> None:
        """Check targets again."""
        self._enabled = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def allowed_prefixes(self) -> tuple[str, ...]:
        return tuple(self._allowed_prefixes)

    @property
    def allowed_exact(self) -> frozenset[str]:
        return frozenset(self._allowed_exact)


target_allowlist = TargetAllowlist()


def _to_plain(config: Any) -> Any:
    """An OmegaConf container as plain dicts/lists (interpolations resolved); anything else unchanged."""
    if config is None or isinstance(config, (dict, list, str, int, float, bool)):
        return config
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return config
    if OmegaConf.is_config(config):
        return OmegaConf.to_container(config, resolve=True)
    return config


def _merge(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` laid over it, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def instantiate(config: Any, *args: Any, mode: InstantiationMode = InstantiationMode.LENIENT, **kwargs: Any) -> Any:
    """Build what ``config`` describes (see the module docstring); None gives None.

    ``config`` is a dict or list (or an OmegaConf container). ``args`` replace the top node's ``_args_``;
    ``kwargs`` are merged over its keys (nested dicts key by key). Returns the built object, a
    ``functools.partial`` for ``_partial_: true``, or the target itself for ``_call_: false``.
    """
    if config is None:
        return None
    config = _to_plain(config)
    if not isinstance(config, (dict, list)):
        raise InstantiationException(
            f"Cannot instantiate config of type {type(config).__name__}: "
            "the top level must be a dict or a list (or an OmegaConf DictConfig/ListConfig)"
        )
    config = _prepare_input_dict_or_list(config)
    kwargs = _prepare_input_dict_or_list(kwargs)
    if isinstance(config, list):
        if kwargs.pop(_Keys.PARTIAL.value, False):
            raise InstantiationException(
                "The _partial_ keyword is not compatible with top-level list instantiation: "
                "set _partial_ on the list's items instead"
            )
        return instantiate_node(config, *args, mode=mode)
    if kwargs:
        config = _merge(config, kwargs)
    partial = config.pop(_Keys.PARTIAL.value, False)
    return instantiate_node(config, *args, partial=partial, mode=mode)


def instantiate_node(
    node: Any, *args: Any, partial: bool = False, mode: InstantiationMode = InstantiationMode.LENIENT
) -> Any:
    """Build one node of a config tree: a ``_target_`` mapping becomes its object, other mappings and lists are
    rebuilt with their items built, anything else is returned as it is."""
    return _build(_to_plain(node), args, partial, mode, "")


def _child_key(full_key: str, key: Any) -> str:
    return f"{full_key}.{key}" if full_key else str(key)


def _build(node: Any, args: tuple, partial: Any, mode: InstantiationMode, full_key: str) -> Any:
    """``instantiate_node`` with the node's dotted path (``full_key``), so errors can say where they are."""
    if not isinstance(node, (dict, list)):
        return node
    if isinstance(node, dict) and _Keys.PARTIAL.value in node:
        partial = node[_Keys.PARTIAL.value]
    if not isinstance(partial, bool):
        raise TypeError(
            _with_key(
                f"_partial_ flag must be a bool (true or false), got {partial!r} ({type(partial).__name__})", full_key
            )
        )
    if isinstance(node, list):
        return [_build(item, (), False, mode, _child_key(full_key, i)) for i, item in enumerate(node)]
    if not _is_target(node):
        return {key: _build(value, (), False, mode, _child_key(full_key, key)) for key, value in node.items()}

    call = node.get(_Keys.CALL.value, True)
    target = _resolve_target(node[_Keys.TARGET.value], full_key, check_callable=call)
    if not call:
        extra = set(node) - {_Keys.TARGET.value, _Keys.CALL.value}
        if extra:
            raise InstantiationException(
                _with_key(
                    f"_call_ was set to False for target {_convert_target_to_string(target)}, so it takes no "
                    f"arguments, but extra keys were found: {sorted(extra)}; remove them or drop '_call_: false'",
                    full_key,
                )
            )
        return target
    kwargs = {
        key: _build(value, (), False, mode, _child_key(full_key, key))
        for key, value in node.items()
        # In a partial, OmegaConf's "???" (a value still to be supplied) is left for the eventual caller.
        if key not in _RESERVED and not (partial and isinstance(value, str) and value == _MISSING)
    }
    kwargs = _filter_kwargs_for_target(target, kwargs, full_key, mode)
    return _call_target(target, partial, args, kwargs, full_key)


def _with_key(message: str, full_key: str) -> str:
    return f"{message}\nfull_key: {full_key}" if full_key else message


def _is_module_missing(error: ModuleNotFoundError, module_path: str) -> bool:
    """True when ``error`` says ``module_path`` itself (or a parent package) does not exist, as opposed to a
    module that exists but fails on one of its own imports."""
    return error.name is not None and (module_path == error.name or module_path.startswith(error.name + "."))


def _locate(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module prefix, then attributes for the rest
    (so ``pkg.mod.Class.method`` works)."""
    if path == "":
        raise ImportError("Empty path: a _target_ must be a dotted path such as 'package.module.Name'")
    parts = path.split(".")
    if any(part == "" for part in parts):
        raise ValueError(
            f"Error loading '{path}': invalid dotstring (an empty part). Relative imports are not supported."
        )
    for end in range(len(parts), 0, -1):
        module_path = ".".join(parts[:end])
        try:
            obj = importlib.import_module(module_path)
        except ModuleNotFoundError as error:
            if _is_module_missing(error, module_path):
                continue
            raise ImportError(f"Error loading '{path}': importing {module_path} failed: {error!r}") from error
        except Exception as error:
            raise ImportError(f"Error loading '{path}': importing {module_path} failed: {error!r}") from error
        for part in parts[end:]:
            try:
                obj = getattr(obj, part)
            except AttributeError as error:
                raise ImportError(
                    f"Error loading '{path}': {error!r}. Are you sure that '{part}' is an attribute of '{module_path}'?"
                ) from error
        return obj
    raise ImportError(
        f"Error loading '{path}': Unable to import any module in the path. Is the package '{parts[0]}' installed?"
    )


def _is_target(x: Any) -> bool:
    """True for a mapping that names a ``_target_``."""
    if isinstance(x, dict):
        return _Keys.TARGET.value in x
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return False
    return OmegaConf.is_dict(x) and _Keys.TARGET.value in x


def _call_target(
    _target_: Callable[..., Any], _partial_: bool, args: tuple[Any, ...], kwargs: dict[str, Any], full_key: str
) -> Any:
    """Call ``_target_`` (or wrap it in a partial); a failure becomes an InstantiationException naming it."""
    args, kwargs = _extract_pos_args(args, kwargs)
    name = _convert_target_to_string(_target_)
    if _partial_:
        try:
            return functools.partial(_target_, *args, **kwargs)
        except Exception as error:
            raise InstantiationException(
                _with_key(f"Error in creating partial({name}, ...) object:\n{error!r}", full_key)
            ) from error
    try:
        return _target_(*args, **kwargs)
    except Exception as error:
        raise InstantiationException(_with_key(f"Error in call to target '{name}':\n{error!r}", full_key)) from error


def _convert_target_to_string(t: Any) -> Any:
    """A callable as its dotted path; anything else unchanged."""
    if callable(t):
        return f"{t.__module__}.{t.__qualname__}"
    return t


def _filter_kwargs_for_target(
    target: Callable[..., Any] | type, kwargs: dict[str, Any], full_key: str, mode: InstantiationMode
) -> dict[str, Any]:
    """``kwargs`` without the keys ``target`` cannot take: dropped with a warning (LENIENT) or refused (STRICT).
    Targets taking ``**kwargs``, or without an inspectable signature, get everything."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {name for name, p in parameters.items() if p.kind in keyword_kinds} | {_Keys.ARGS.value}
    unexpected = sorted(set(kwargs) - accepted)
    if not unexpected:
        return kwargs
    name = _convert_target_to_string(target)
    if mode == InstantiationMode.STRICT:
        raise InstantiationException(
            _with_key(
                f"Unexpected config keys for target '{name}': {unexpected}; it accepts {sorted(accepted)}", full_key
            )
        )
    logger.warning(_with_key(f"Dropping unexpected config keys for target '{name}': {unexpected}", full_key))
    return {key: value for key, value in kwargs.items() if key in accepted}


def _prepare_input_dict_or_list(d: dict[Any, Any] | list[Any]) -> Any:
    """A copy of the dict/list tree, with every callable ``_target_`` written as its dotted path (so it goes
    through the allow-list like a string from a file)."""
    if isinstance(d, dict):
        result = {}
        for key, value in d.items():
            if key == _Keys.TARGET.value:
                value = _convert_target_to_string(value)
            elif isinstance(value, (dict, list)):
                value = _prepare_input_dict_or_list(value)
            result[key] = value
        return result
    if isinstance(d, list):
        return [_prepare_input_dict_or_list(v) if isinstance(v, (dict, list)) else v for v in d]
    raise InstantiationException(f"Expected a dict or list, got {type(d).__name__}")


def _refusal(target: str, full_key: str) -> str:
    module = target.rsplit(".", 1)[0] + "."
    return _with_key(
        f"Target '{target}' is not in the allowlist for _target_ instantiation, so it was not imported.\n"
        f"Allowed module prefixes: {', '.join(target_allowlist.allowed_prefixes)}\n"
        f"Allowed exact targets: {', '.join(sorted(target_allowlist.allowed_exact))}\n"
        "If you trust this config, allow the target before loading it:\n"
        f"  target_allowlist.add_prefix('{module}')\n"
        f"  or: target_allowlist.add_exact('{target}')",
        full_key,
    )


def _origin(obj: Any) -> str | None:
    """Where ``obj`` is defined: ``module.QualifiedName`` for functions and classes, the name for a module,
    None for plain values (dtypes, enum members) that carry no such record."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__ + "."
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    return None


def _check_origin(path: str, obj: Any, full_key: str) -> None:
    """Refuse what a prefix admits by name only. An allowed module may import other modules or functions
    (``megatron.training.config.container.os.system`` is ``os.system``), so an object reached through a prefix
    must also be defined under an allowed path. The allow-list's own module is never a target, so a config cannot
    switch the check off (``target_allowlist.disable``). A path added with ``add_exact`` is trusted as it is."""
    if not target_allowlist.enabled:
        return
    if path.startswith(__name__ + ".") or isinstance(getattr(obj, "__self__", obj), TargetAllowlist):
        raise InstantiationException(
            _with_key(f"Target '{path}' is in {__name__}, which configs may not call or reference", full_key)
        )
    if path in target_allowlist.allowed_exact:
        return
    origin = _origin(obj)
    if origin is not None and not target_allowlist.is_allowed(origin):
        raise InstantiationException(
            _with_key(
                f"Target '{path}' is '{origin}' imported into an allowed module, and '{origin}' is not in the "
                f"allowlist. If you trust this config, call target_allowlist.add_exact('{path}')",
                full_key,
            )
        )


def _resolve_target(
    target: str | type | Callable[..., Any], full_key: str, check_callable: bool = True
) -> type | Callable[..., Any] | object:
    """The object a ``_target_`` names. A string is checked against the allow-list before it is imported; an
    object given directly (already imported by the caller) is used as it is."""
    if isinstance(target, str):
        if not target_allowlist.is_allowed(target):
            raise InstantiationException(_refusal(target, full_key))
        path = target
        try:
            target = _locate(path)
        except Exception as error:
            raise InstantiationException(_with_key(f"Error locating target '{path}': {error}", full_key)) from error
        _check_origin(path, target, full_key)
    if check_callable and not callable(target):
        raise InstantiationException(
            _with_key(
                f"Expected a callable target, got '{target}' of type '{type(target).__name__}'; "
                "set '_call_: false' to use it as a value",
                full_key,
            )
        )
    return target


def _extract_pos_args(input_args: Any, kwargs: Any) -> tuple[Any, Any]:
    """(positional args, kwargs without ``_args_``): the caller's args when given, else the config's ``_args_``."""
    config_args = kwargs.pop(_Keys.ARGS.value, ())
    if not isinstance(config_args, (list, tuple)):
        raise InstantiationException(
            f"Unsupported _args_ type: '{type(config_args).__name__}'. value: '{config_args}'; _args_ must be a list"
        )
    return (input_args if len(input_args) > 0 else config_args), kwargs


def _convert_node(node: Any) -> Any:
    """An OmegaConf node as plain containers; anything else unchanged."""
    return _to_plain(node)
