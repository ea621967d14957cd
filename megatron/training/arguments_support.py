"""Megatron-LM's flags for what this project does not do, as data: each table names its flags and what they are for.

Every Megatron-LM flag parses here with Megatron-LM's dest, default, type, choices and nargs, so a launch script
written for Megatron-LM gets past argument parsing. What happens next depends on the table the flag is in:

- a table with ``not_supported=<feature>``: the feature is not built yet; ``validate_args`` refuses a non-default
  value with "not supported yet: <feature> (--flag value)", before any process group exists;
- a table with ``no_effect=<what it tunes>``: the flag only tunes GPU kernels or a vendor service; a non-default
  value is reset to the default with one warning (rank 0) that it has no effect here;
- a table with neither: the flag works; its behaviour lives in ``argument_validation`` or the config builders.

The rows are written with three helpers, ``switch`` (store_true; or store_false with ``off_switch``),
``bool_optional`` (``--x`` / ``--no-x``) and ``value`` (an option with a value), each holding Megatron-LM's facts.
"""

import argparse
import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from megatron.core.utils import warn_once


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag: its option strings and the ``add_argument`` keyword arguments."""

    options: Tuple[str, ...]
    kwargs: Dict[str, Any]

    @property
    def dest(self) -> str:
        return self.kwargs["dest"]

    @property
    def default(self):
        return self.kwargs.get("default")


def _options_and_dest(options: str, dest: Optional[str]) -> Tuple[Tuple[str, ...], str]:
    names = tuple(name.strip() for name in options.split(","))
    return names, dest or names[0][2:].replace("-", "_")


def switch(options: str, dest: Optional[str] = None, default=False, help: Optional[str] = None) -> Flag:
    """A store_true flag (off unless given)."""
    names, dest = _options_and_dest(options, dest)
    return Flag(names, {"action": "store_true", "dest": dest, "default": default, "help": help})


def off_switch(options: str, dest: str, help: Optional[str] = None) -> Flag:
    """A store_false flag (``--no-x``, ``--disable-x``): ``dest`` is on unless the flag is given."""
    names, dest = _options_and_dest(options, dest)
    return Flag(names, {"action": "store_false", "dest": dest, "default": True, "help": help})


def bool_optional(option: str, dest: Optional[str] = None, default=False, help: Optional[str] = None) -> Flag:
    """``--x`` / ``--no-x`` (argparse.BooleanOptionalAction)."""
    names, dest = _options_and_dest(option, dest)
    return Flag(names, {"action": argparse.BooleanOptionalAction, "dest": dest, "default": default, "help": help})


def value(
    options: str,
    type,
    default,
    dest: Optional[str] = None,
    choices: Optional[Sequence] = None,
    nargs=None,
    help: Optional[str] = None,
) -> Flag:
    """An option taking a value (``type`` None: the string as given)."""
    names, dest = _options_and_dest(options, dest)
    kwargs = {"type": type, "dest": dest, "default": default, "help": help}
    if choices is not None:
        kwargs["choices"] = choices
    if nargs is not None:
        kwargs["nargs"] = nargs
    return Flag(names, kwargs)


@dataclasses.dataclass(frozen=True)
class FlagTable:
    """Flags of one Megatron-LM argument group that share a status (see the module docstring)."""

    group: str
    flags: Tuple[Flag, ...]
    not_supported: Optional[str] = None
    no_effect: Optional[str] = None

    def help_for(self, flag: Flag) -> str:
        if flag.kwargs.get("help"):
            return flag.kwargs["help"]
        if self.not_supported:
            return f"{_capitalized(self.not_supported)}: not supported yet here (refused when set)."
        if self.no_effect:
            return f"{_capitalized(self.no_effect)}: accepted for compatibility; has no effect here (warns when set)."
        raise ValueError(f"{flag.options[0]} works here and needs its own help text")


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def argument_group(parser: argparse.ArgumentParser, title: str):
    """The parser's argument group called ``title`` (created on first use), so each group prints once in --help."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title=title)


def add_flag_tables(
    parser: argparse.ArgumentParser, tables: Iterable[FlagTable], named_types: Dict[str, Any]
) -> argparse.ArgumentParser:
    """Add every flag of ``tables`` to its Megatron-LM argument group of ``parser``; a row's type given by name
    (``"moe_freq_type"``) is looked up in ``named_types``."""
    for table in tables:
        group = argument_group(parser, table.group)
        for flag in table.flags:
            kwargs = dict(flag.kwargs, help=table.help_for(flag))
            if kwargs.get("type") is None:
                kwargs.pop("type", None)
            elif isinstance(kwargs["type"], str):
                kwargs["type"] = named_types[kwargs["type"]]
            group.add_argument(*flag.options, **kwargs)
    return parser


def _flags_by_dest(tables: Iterable[FlagTable]):
    """``(table, flag)`` for the first flag of each dest: when two flags share a dest (``--x`` / ``--no-x``), the
    first one added gives the namespace its default, which is what "set" is measured against."""
    seen = set()
    for table in tables:
        for flag in table.flags:
            if flag.dest not in seen:
                seen.add(flag.dest)
                yield table, flag


def _is_set(args, flag: Flag) -> bool:
    current = getattr(args, flag.dest, flag.default)
    if isinstance(current, list) and len(current) == 1 and not isinstance(flag.default, list):
        current = current[0]  # a nargs flag given its (scalar) default, e.g. --moe-router-load-balancing-type aux_loss
    return current != flag.default


def _as_typed(flag: Flag, current) -> str:
    """How the user typed the setting: ``--flag`` for a switch, ``--flag value`` otherwise."""
    action = flag.kwargs.get("action")
    if action in ("store_true", "store_false"):
        return flag.options[0]
    if action is argparse.BooleanOptionalAction:
        return flag.options[0] if current else f"--no-{flag.options[0][2:]}"
    shown = " ".join(str(item) for item in current) if isinstance(current, (list, tuple)) else current
    return f"{flag.options[0]} {shown}"


def refuse_features_not_built(args, tables: Iterable[FlagTable], unsupported_values: Dict[str, Dict[Any, str]]) -> None:
    """Raise one ValueError naming every flag that asks for a feature this project has not built yet, grouped by
    feature: "not supported yet: <feature> (--flag value, --other-flag); <feature> (...)".

    ``unsupported_values`` maps a dest to the choices of an implemented flag that are not built yet (e.g.
    ``--position-embedding-type yarn``) and the feature each one needs."""
    refused: Dict[str, List[str]] = {}
    for table, flag in _flags_by_dest(tables):
        if table.not_supported is not None and _is_set(args, flag):
            refused.setdefault(table.not_supported, []).append(_as_typed(flag, getattr(args, flag.dest)))
    for dest, features in unsupported_values.items():
        current = getattr(args, dest, None)
        if current in features:
            refused.setdefault(features[current], []).append(f"--{dest.replace('_', '-')} {current}")
    if refused:
        features = "; ".join(f"{feature} ({', '.join(flags)})" for feature, flags in refused.items())
        raise ValueError(f"not supported yet: {features}. Remove the flag(s) or use the default.")


def ignore_flags_without_effect(args, tables: Iterable[FlagTable]) -> List[str]:
    """Reset every no-effect flag that was set to its default, warning once (rank 0); the flags reset."""
    ignored = []
    for table, flag in _flags_by_dest(tables):
        if table.no_effect is not None and _is_set(args, flag):
            typed = _as_typed(flag, getattr(args, flag.dest))
            if getattr(args, "rank", 0) == 0:
                warn_once(f"{typed} has no effect here ({table.no_effect}); ignoring it")
            setattr(args, flag.dest, flag.default)
            ignored.append(flag.options[0])
    return ignored
