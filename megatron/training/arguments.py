"""Megatron-LM's command line: ``parse_args`` and ``validate_args``, with Megatron-LM's flag names and defaults.

Flags are organised in Megatron-LM's groups (``add_network_size_args``, ``add_training_args``, ...), written in
``arguments_model_groups`` and ``arguments_run_groups``. A flag that is the mechanical image of a config dataclass
field is generated from that field (``add_field_argument``: name, type, default and help come from the dataclass).
Every other Megatron-LM flag comes from the tables of ``arguments_model_flags``, ``arguments_run_flags`` and
``arguments_service_flags`` (see ``arguments_support``, collected in ``flag_tables``): it parses with Megatron-LM's
dest, default, type and choices, and ``validate_args`` refuses it when set ("not supported yet: <feature> (--flag)")
or, for a GPU-kernel or vendor-service knob, ignores it with one warning. ``validate_args`` derives the values
Megatron-LM derives (data-parallel size, global batch size, FFN size, ...) and turns every inconsistent setting into
one ``ValueError`` that names the flags and the fix, before any process group exists. An unknown flag exits (status
2) with one line naming the closest known flag.

Where this project differs from Megatron-LM, the flag's help says so: ``--transformer-impl`` defaults to ``local``
(``transformer_engine`` builds the same PyTorch modules in Transformer Engine's checkpoint layout), and GPU-only
switches (fused kernels, ``--distributed-backend nccl`` without a GPU) are accepted and turned off with one warning
when they cannot apply on this machine.
"""

import argparse
import difflib
import os
import sys
from typing import List

from megatron.training import argument_validation
from megatron.training.argument_utils import (
    CONFIG_FIELD_RENAMES,
    core_ddp_config_from_args,
    core_gpt_dataset_config_from_args,
    core_optimizer_config_from_args,
    core_transformer_config_from_args,
    get_blend_and_blend_per_split,
)
from megatron.training.arguments_model_flags import HETEROGENEOUS
from megatron.training.arguments_model_groups import (
    add_experimental_args,
    add_initialization_args,
    add_mixed_precision_args,
    add_moe_args,
    add_network_size_args,
    add_regularization_args,
    add_tokenizer_args,
    add_transformer_engine_args,
)
from megatron.training.arguments_run_groups import (
    add_checkpointing_args,
    add_data_args,
    add_deprecated_args,
    add_distributed_args,
    add_learning_rate_args,
    add_logging_args,
    add_training_args,
    add_validation_args,
)
from megatron.training.arguments_support import add_flag_tables, refuse_features_not_built

# The choice lists and flag types live in flag_tables (validate_args reads them too); importable from here as before.
from megatron.training.flag_errors import flag_spellings, in_flag_terms
from megatron.training.flag_tables import (  # noqa: F401
    CKPT_FORMATS,
    FLAG_TABLES,
    NAMED_TYPES,
    OPTIMIZERS,
    POSITION_EMBEDDING_TYPES,
    TOKENIZER_TYPES,
    la_freq_type,
    moe_freq_type,
    no_rope_freq_type,
    tuple_type,
)
from megatron.training.yaml_config import yaml_settings

# Megatron-LM's private name for the network-size group, which its unit tests call directly.
_add_network_size_args = add_network_size_args

__all__ = [
    "parse_args",
    "parse_args_list",
    "parse_and_validate_args",
    "build_parser",
    "add_megatron_arguments",
    "validate_args",
    "validate_model_config_args_from_heterogeneous_config",
    "moe_freq_type",
    "la_freq_type",
    "no_rope_freq_type",
    "tuple_type",
    # The config builders, importable from here as in Megatron-LM.
    "core_transformer_config_from_args",
    "core_ddp_config_from_args",
    "core_optimizer_config_from_args",
    "core_gpt_dataset_config_from_args",
    "get_blend_and_blend_per_split",
]


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add all of Megatron-LM's arguments to ``parser``: the ones this project implements, in Megatron-LM's
    groups, then the tables of the ones it does not (accepted, refused or ignored when set: see arguments_support)."""
    parser = add_network_size_args(parser)
    parser = add_regularization_args(parser)
    parser = add_training_args(parser)
    parser = add_initialization_args(parser)
    parser = add_learning_rate_args(parser)
    parser = add_checkpointing_args(parser)
    parser = add_mixed_precision_args(parser)
    parser = add_distributed_args(parser)
    parser = add_validation_args(parser)
    parser = add_data_args(parser)
    parser = add_tokenizer_args(parser)
    parser = add_moe_args(parser)
    parser = add_logging_args(parser)
    parser = add_transformer_engine_args(parser)
    parser = add_experimental_args(parser)
    parser = add_deprecated_args(parser)
    return add_flag_tables(parser, FLAG_TABLES, NAMED_TYPES)


class MegatronArgumentParser(argparse.ArgumentParser):
    """argparse with short errors: an unknown flag gets one line with the closest known flag, and no error prints
    the usage (with 800 flags it would bury the message); ``--help`` still lists every flag. Under torchrun only
    rank 0 prints (every rank exits with status 2), so a job shows the message once."""

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self._exit_on_unknown(unknown)
        return parsed

    def _exit_on_unknown(self, unknown: List[str]) -> None:
        known = [option for action in self._actions for option in action.option_strings]
        lines = []
        for item in unknown:
            if not item.startswith("-"):
                continue  # the value of the unknown flag before it
            flag = item.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1)
            lines.append(f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else ""))
        if not lines:
            lines = [f"unexpected argument(s): {' '.join(unknown)}"]
        self._exit_once("\n".join(lines))

    def error(self, message):
        self._exit_once(f"{self.prog}: error: {message} (--help lists every flag)")

    def _exit_once(self, message: str) -> None:
        self.exit(2, message + "\n" if int(os.getenv("RANK", "0")) == 0 else None)


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    """The argument parser ``parse_args`` uses, with ``extra_args_provider(parser)`` applied when given."""
    parser = MegatronArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """Parse the command line (``sys.argv[1:]``) into Megatron-LM's argument namespace (see ``parse_args_list``)."""
    return parse_args_list(sys.argv[1:], extra_args_provider, ignore_unknown_args)


def parse_args_list(argv: List[str], extra_args_provider=None, ignore_unknown_args=False):
    """``parse_args`` of the argument list ``argv`` instead of ``sys.argv[1:]``.

    With ``--yaml-cfg FILE`` the file's settings replace the defaults and flags given on the command line still win.
    ``rank`` and ``world_size`` come from torchrun's ``RANK`` and ``WORLD_SIZE`` (0 and 1 without them). The result
    still has to go through ``validate_args``. An unknown flag exits with status 2 and one line naming the closest
    known flag (unless ``ignore_unknown_args``).
    """
    parser = build_parser(extra_args_provider)
    argv = list(argv)

    def parse():
        if ignore_unknown_args:
            return parser.parse_known_args(argv)[0]
        return parser.parse_args(argv)

    args = parse()
    if args.yaml_cfg is not None:
        parser.set_defaults(**yaml_settings(args.yaml_cfg, parser))
        args = parse()
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args


def validate_args(args, defaults={}):
    """Megatron-LM's ``validate_args``: refuse flags for features not built yet, ignore (with a warning) flags that
    have no effect here, check every setting and fill in the derived values. See ``argument_validation``.

    A failure names what the user typed: the config checks run here name their fields (``moe_router_topk=5``), and
    their message is rewritten into flags (``--moe-router-topk 5``, see ``flag_errors``)."""
    try:
        return argument_validation.validate_args(args, defaults)
    except ValueError as error:
        message = in_flag_terms(str(error), flag_spellings(build_parser(), CONFIG_FIELD_RENAMES))
        if message == str(error):
            raise
        try:
            translated = type(error)(message)
        except TypeError:  # a subclass with another constructor
            translated = ValueError(message)
        raise translated from error


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
    """``parse_args``, then (with ``--use-checkpoint-args``) the model arguments from the checkpoint, then
    ``validate_args``; the result becomes the run's arguments (``get_args()``), which ``initialize_megatron``
    starts from."""
    from megatron.training.checkpoint_args import load_args_from_checkpoint
    from megatron.training.global_vars import set_args

    args = parse_args(extra_args_provider, ignore_unknown_args)
    if args.use_checkpoint_args or args_defaults.get("use_checkpoint_args", False):
        load_args_from_checkpoint(args)
    validate_args(args, args_defaults)
    set_args(args)
    return args


def validate_model_config_args_from_heterogeneous_config(args):
    """Megatron-LM's check of the arguments against a heterogeneous layer config (``--heterogeneous-layers-config-
    path`` / ``-encoded-json``). Such configs are not supported yet: a run that names one is refused, with the
    message validate_args gives."""
    refuse_features_not_built(args, (HETEROGENEOUS,), {})
    return args
