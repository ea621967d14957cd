"""Config errors in the words of the command line.

The config dataclasses (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig, ...) check themselves and
name their fields: ``moe_router_topk=5 is larger than num_moe_experts=4``. That is right for a library user, who
wrote those fields, but a user of ``pretrain_gpt.py`` typed ``--moe-router-topk 5 --num-experts 4``. So when
``validate_args`` fails, its message goes through :func:`in_flag_terms`, which rewrites every field (or argument
dest) the parser has a flag for into that flag, from the parser's own dest -> option table:

- ``name=value`` becomes ``--flag value`` (quotes dropped); a switch becomes ``--flag`` when the value is the one
  the flag sets and ``without --flag`` otherwise (``add_bias_linear=False`` is ``--disable-bias-linear``);
- ``Config.name`` and a bare ``name`` become ``--flag``, except for a switch that turns something off, which keeps
  the name and adds the flag (``add_bias_linear (--disable-bias-linear)``) so the sentence keeps its meaning;
- a one-word name (``fp16``, ``normalization``) is rewritten only in the ``name=value`` form, where it cannot be an
  ordinary word of the sentence.

Fields without a flag of their own (derived ones such as ``pipeline_dtype``) keep their names.
"""

import argparse
import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

# A value after "name=": a quoted string, a list or tuple, or a token up to a separator.
_VALUE = r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\([^)]*\)|[^\s,;:)]+"


@dataclass(frozen=True)
class FlagSpelling:
    flag: str
    sets: Optional[bool]  # what the flag stores for a switch (True / False); None for a flag that takes a value
    negated: Optional[str] = None  # the --no-x spelling of an argparse.BooleanOptionalAction


def _main_option(action: argparse.Action) -> str:
    """The spelling of the dest itself when the flag has it (``--save-interval``, not ``--persistent-save-interval``),
    else the first long option."""
    own = "--" + action.dest.replace("_", "-")
    long_options = [option for option in action.option_strings if option.startswith("--")]
    return own if own in long_options else (long_options or action.option_strings)[0]


def flag_spellings(parser: argparse.ArgumentParser, renames: Mapping[str, str] = {}) -> Dict[str, FlagSpelling]:
    """Each argument dest of ``parser`` and each config field of ``renames`` (field -> dest) -> its flag."""
    spellings: Dict[str, FlagSpelling] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in spellings or action.dest == "help":
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            negated = next(option for option in action.option_strings if option.startswith("--no-"))
            spellings[action.dest] = FlagSpelling(_main_option(action), True, negated)
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            spellings[action.dest] = FlagSpelling(_main_option(action), action.const)
        else:
            spellings[action.dest] = FlagSpelling(_main_option(action), None)
    for field, dest in renames.items():
        if dest in spellings:
            spellings[field] = spellings[dest]
    return spellings


def _with_value(spelling: FlagSpelling, value: str) -> str:
    if spelling.sets is None:
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        return f"{spelling.flag} {value}"
    if value not in ("True", "False"):
        return f"{spelling.flag} {value}"
    if (value == "True") == spelling.sets:
        return spelling.flag
    return spelling.negated or f"without {spelling.flag}"


def in_flag_terms(message: str, spellings: Mapping[str, FlagSpelling]) -> str:
    """``message`` with the names in ``spellings`` written as flags (see the module docstring)."""
    if not spellings:
        return message
    names = "|".join(map(re.escape, sorted(spellings, key=len, reverse=True)))
    # Not inside a longer name, a flag, a path or an attribute (``config.hidden_size`` is code, not a setting).
    pattern = re.compile(rf"(?<![\w./-])(?:[A-Z]\w*Config\.)?({names})(?![\w-])(?:=({_VALUE}))?")

    def rewrite(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        spelling = spellings[name]
        if value is not None:
            stripped = value.rstrip(".")  # a value that ends the sentence keeps its full stop
            return _with_value(spelling, stripped) + value[len(stripped) :]
        if "_" not in name:
            return match.group(0)
        if spelling.sets is False:
            return f"{name} ({spelling.flag})"
        return spelling.flag

    return pattern.sub(rewrite, message)
