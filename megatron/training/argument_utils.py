"""Command-line flags generated from config dataclass fields, and the config builders that read them back.

A Megatron-Core config dataclass documents each field with a string literal right after it. Where a flag is the
mechanical image of a field (``num_layers`` -> ``--num-layers``, same type, same meaning), ``add_field_argument``
builds it from the field: its name, type, default and help text, so nothing is copied by hand. Megatron-LM's
flags differ from the field in a few ways (``--norm-epsilon`` for ``layernorm_epsilon``, a ``None`` default where
the field has ``0``), which the caller states as overrides.

The ``*_from_args`` builders go the other way: they fill a config dataclass from the parsed arguments by matching
field names, plus the renames listed next to each builder (as Megatron-LM's training code does).
"""

import argparse
import ast
import dataclasses
import enum
import functools
import importlib
import inspect
import json
import re
import textwrap
import types
import typing
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.activations import squared_relu
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import openai_gelu

_NOT_GIVEN = object()

# Megatron-LM's config-container builders live in config_from_args (they import the config and model packages,
# which import this module); importable from here, Megatron-LM's path.
_MOVED = {
    "pretrain_cfg_container_from_args": "megatron.training.config_from_args",
    "gpt_config_from_args": "megatron.training.config_from_args",
    "hybrid_config_from_args": "megatron.training.config_from_args",
    "inference_cfg_from_args": "megatron.training.config_from_args",
    "inference_cfg_container_from_args": "megatron.training.config_from_args",
}


def __getattr__(name):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=None)
def config_field_docs(config_class: type) -> Dict[str, str]:
    """The docstring of every field of a dataclass (the string literal after it), inherited fields included."""
    docs: Dict[str, str] = {}
    for klass in reversed(config_class.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        class_node = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        body = class_node.body
        for statement, following in zip(body, body[1:]):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                text = " ".join(inspect.cleandoc(following.value.value).split())
                # Field docs may name their flag, e.g. "(`--mock-data`)": the flag's own help needs no such pointer.
                docs[statement.target.id] = re.sub(r"\s*\(`--[^)]*\)", "", text)
    return docs


def _field(config_class: type, name: str) -> dataclasses.Field:
    for candidate in dataclasses.fields(config_class):
        if candidate.name == name:
            return candidate
    raise ValueError(f"{config_class.__name__} has no field {name!r}")


def _value_type(config_class: type, name: str):
    """The field's type with Optional[...] removed."""
    annotation = typing.get_type_hints(config_class)[name]
    if typing.get_origin(annotation) is typing.Union:
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _lower_first(text: str) -> str:
    """``Fuse x`` -> ``fuse x``, leaving acronyms (``SDPA``) alone."""
    if len(text) > 1 and text[0].isupper() and text[1].islower():
        return text[0].lower() + text[1:]
    return text


def enum_by_name(enum_class: type):
    """An argparse ``type`` turning a member name (``flash``) into the enum member, naming the choices on error."""

    def convert(text):
        if isinstance(text, enum_class):
            return text
        try:
            return enum_class[text]
        except KeyError:
            names = ", ".join(member.name for member in enum_class)
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {names})") from None

    convert.__name__ = "enum_type_handler"  # Megatron-LM's name for this argparse type
    return convert


def add_field_argument(
    group,
    config_class: type,
    name: str,
    *,
    flags: Optional[list] = None,
    dest: Optional[str] = None,
    default: Any = _NOT_GIVEN,
    help_suffix: str = "",
    **argparse_kwargs,
) -> argparse.Action:
    """Add the flag for ``config_class.<name>`` to ``group`` (an argparse parser or argument group).

    By default the flag is ``--<name with dashes>``, the dest is the field name, the default is the field's
    default and the help is the field's docstring. A bool field becomes a switch: ``--<name>`` (store_true) when
    its default is False, ``--no-<name>`` (store_false) when it is True. An Enum field takes a member name. Any
    of these can be overridden; ``argparse_kwargs`` go to ``add_argument`` unchanged.
    """
    field = _field(config_class, name)
    docs = config_field_docs(config_class)
    if name not in docs:
        raise ValueError(f"{config_class.__name__}.{name} has no docstring to use as --help text; document the field")
    if default is _NOT_GIVEN:
        default = field.default
    value_type = _value_type(config_class, name)
    kwargs: Dict[str, Any] = {"dest": dest or name, "default": default, "help": docs[name] + help_suffix}
    dashed = name.replace("_", "-")
    if value_type is bool:
        kwargs["action"] = "store_false" if default is True else "store_true"
        flags = flags or [f"--no-{dashed}" if default is True else f"--{dashed}"]
        if default is True:
            kwargs["help"] = "Turn off (on by default): " + _lower_first(kwargs["help"])
    elif isinstance(value_type, type) and issubclass(value_type, enum.Enum):
        kwargs["type"] = enum_by_name(value_type)
        kwargs["metavar"] = "{" + ",".join(member.name for member in value_type) + "}"
    elif value_type in (int, float, str):
        kwargs["type"] = value_type
    elif typing.get_origin(value_type) is list and len(typing.get_args(value_type)) == 1:
        kwargs["type"] = typing.get_args(value_type)[0]
        kwargs["nargs"] = "+"
    elif "type" not in argparse_kwargs:
        raise TypeError(
            f"cannot derive a command-line type for {config_class.__name__}.{name} ({value_type}); pass type=..."
        )
    kwargs.update(argparse_kwargs)
    return group.add_argument(*(flags or [f"--{dashed}"]), **kwargs)


class TypeInferenceError(Exception):
    """A config field whose type cannot become a command-line argument (a Union, a Callable, ...) and that gives
    no ``argparse_meta`` to say how to parse it."""


class ArgumentGroupFactory:
    """Adds one argparse group to a parser, one flag per field of a config dataclass (Megatron-LM's generator).

    Each field ``name`` becomes ``--name`` (underscores as dashes) with the field's default (its default_factory
    called), its docstring as help and a type read from its annotation: ``Optional[X]`` as ``X``, ``list[X]`` as
    ``nargs="+"``, a ``Literal`` as choices, an ``Enum`` by member name. A bool field is a switch: ``--name`` when
    it defaults to False, ``--no-name`` / ``--disable-name`` when it defaults to True. A field's
    ``metadata["argparse_meta"]`` dict is applied last, over everything inferred (``arg_names`` sets the flags,
    the other keys go to ``add_argument``); with it, a field of a type argparse cannot parse is still accepted.
    Fields named in ``exclude`` and fields with ``init=False`` get no flag.
    """

    def __init__(self, src_cfg_class: type, exclude: Optional[list] = None) -> None:
        self.src_cfg_class = src_cfg_class
        self.field_docstrings = self._get_field_docstrings(src_cfg_class)
        self.exclude = set(exclude or ())

    def _format_arg_name(self, config_attr_name: str, prefix: Optional[str] = None) -> str:
        """``learning_rate`` -> ``--learning-rate``; with ``prefix="no"``, ``--no-learning-rate``."""
        name = f"{prefix}_{config_attr_name}" if prefix else config_attr_name
        return "--" + name.replace("_", "-")

    def _get_enum_kwargs(self, config_type: type) -> Dict[str, Any]:
        """An enum flag takes a member name (``SIGINT``) and stores the member."""

        def enum_type_handler(cli_arg):
            try:
                return config_type[cli_arg]
            except KeyError:
                names = ", ".join(member.name for member in config_type)
                # A KeyError, as Megatron-LM raises, but one that names the choices.
                raise KeyError(f"{cli_arg!r} is not a member of {config_type.__name__}; choose from {names}") from None

        return {"type": enum_type_handler, "choices": list(config_type)}

    def _extract_type(self, config_type) -> Dict[str, Any]:
        """The ``type`` / ``nargs`` / ``choices`` arguments for a field annotated ``config_type``."""
        origin = typing.get_origin(config_type)
        members = typing.get_args(config_type)
        if isinstance(config_type, type) and issubclass(config_type, enum.Enum):
            return self._get_enum_kwargs(config_type)
        if origin is None and isinstance(config_type, type):
            return {"type": config_type}
        if origin in (typing.Union, types.UnionType):
            present = [member for member in members if member is not type(None)]
            if len(present) == 1:
                return self._extract_type(present[0])
            raise TypeInferenceError(f"Unions not supported by argparse: {config_type}")
        if origin is list:
            if len(members) != 1:
                raise TypeInferenceError(f"Multi-type lists not supported by argparse: {config_type}")
            return {**self._extract_type(members[0]), "nargs": "+"}
        if origin is typing.Literal:
            choice_types = {type(member) for member in members}
            if len(choice_types) != 1:
                raise TypeInferenceError(f"Literal choices of mixed types not supported by argparse: {config_type}")
            return {"type": choice_types.pop(), "choices": members}
        raise TypeInferenceError(f"Unsupported type: {config_type}")

    def _build_argparse_kwargs_from_field(self, attribute: dataclasses.Field) -> Dict[str, Any]:
        """``add_argument`` keyword arguments for one field, plus ``arg_names`` (its flags)."""
        if attribute.default is dataclasses.MISSING and attribute.default_factory is not dataclasses.MISSING:
            default = attribute.default_factory()
        else:
            default = attribute.default
        kwargs: Dict[str, Any] = {
            "arg_names": [self._format_arg_name(attribute.name)],
            "dest": attribute.name,
            "help": self.field_docstrings.get(attribute.name, ""),
            "default": default,
        }
        meta = attribute.metadata.get("argparse_meta")
        try:
            kwargs.update(self._extract_type(self._annotation(attribute)))
        except TypeInferenceError as error:
            if meta is None:
                raise TypeInferenceError(
                    f"{self.src_cfg_class.__name__}.{attribute.name}: {error}; give the field "
                    'metadata={"argparse_meta": {"type": ...}} or exclude it from the ArgumentGroupFactory'
                ) from None
        if kwargs.get("type") is bool:
            del kwargs["type"]
            if default is True:
                kwargs["action"] = "store_false"
                kwargs["arg_names"] = [
                    self._format_arg_name(attribute.name, prefix="no"),
                    self._format_arg_name(attribute.name, prefix="disable"),
                ]
            else:
                kwargs["action"] = "store_true"
        kwargs.update(meta or {})
        return kwargs

    def _annotation(self, attribute: dataclasses.Field):
        """The field's annotation as a type, also where the module uses ``from __future__ import annotations``."""
        if not isinstance(attribute.type, str):
            return attribute.type
        return typing.get_type_hints(self.src_cfg_class)[attribute.name]

    def build_group(self, parser: argparse.ArgumentParser, title: Optional[str] = None):
        """Add the group (titled ``title``, described by the class docstring) and its flags; return the group."""
        group = parser.add_argument_group(title=title, description=self.src_cfg_class.__doc__)
        for attribute in dataclasses.fields(self.src_cfg_class):
            if attribute.name in self.exclude or not attribute.init:
                continue
            kwargs = self._build_argparse_kwargs_from_field(attribute)
            group.add_argument(*kwargs.pop("arg_names"), **kwargs)
        return group

    def _get_field_docstrings(self, src_cfg_class: type) -> Dict[str, str]:
        """Every field's docstring (the string literal after it), inherited fields included."""
        return dict(config_field_docs(src_cfg_class))


# ---------------------------------------------------------------------------------------------------------------
# Config builders: dataclass field <- argument. A field not listed takes the argument of the same name, if any.
# ---------------------------------------------------------------------------------------------------------------

TRANSFORMER_CONFIG_RENAMES = {
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "num_moe_experts": "num_experts",
}
"""TransformerConfig fields whose Megatron-LM flag has another name (field -> argument dest)."""

DDP_CONFIG_RENAMES = {
    "grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32",
    "check_for_nan_in_grad": "check_for_nan_in_loss_and_grad",
    "bucket_size": "ddp_bucket_size",
    "pad_buckets_for_high_nccl_busbw": "ddp_pad_buckets_for_high_nccl_busbw",
    "average_in_collective": "ddp_average_in_collective",
}
"""DistributedDataParallelConfig fields whose Megatron-LM flag has another name (field -> argument dest)."""

CONFIG_FIELD_RENAMES = {**TRANSFORMER_CONFIG_RENAMES, **DDP_CONFIG_RENAMES}
"""Every config field whose flag has another name (field -> argument dest), for messages in flag terms."""


def config_kwargs_from_args(config_class: type, args, renames: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Keyword arguments for ``config_class`` taken from ``args`` by field name (or by ``renames[field]``)."""
    renames = renames or {}
    kwargs = {}
    for field in dataclasses.fields(config_class):
        if not field.init:
            continue
        source = renames.get(field.name, field.name)
        if hasattr(args, source):
            kwargs[field.name] = getattr(args, source)
    return kwargs


def core_transformer_config_from_args(args, config_class=None):
    """The TransformerConfig (or ``config_class``) described by validated arguments, as Megatron-LM builds it."""
    config_class = config_class or TransformerConfig
    kwargs = config_kwargs_from_args(config_class, args, TRANSFORMER_CONFIG_RENAMES)
    kwargs["persist_layer_norm"] = not args.no_persist_layer_norm
    kwargs["deallocate_pipeline_outputs"] = True
    # Megatron-LM has no --cpu-offloading: offloading N > 0 layers turns it on.
    kwargs["cpu_offloading"] = getattr(args, "cpu_offloading_num_layers", 0) > 0
    kwargs["pipeline_dtype"] = args.params_dtype
    kwargs["batch_p2p_comm"] = not args.overlap_p2p_comm
    kwargs["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    if isinstance(args.cp_comm_type, list) and len(args.cp_comm_type) == 1:
        kwargs["cp_comm_type"] = args.cp_comm_type[0]  # one value for every layer, as Megatron-LM passes it
    if args.swiglu:
        kwargs["activation_func"] = F.silu
        kwargs["gated_linear_unit"] = True
        kwargs["bias_activation_fusion"] = args.bias_swiglu_fusion
    else:
        kwargs["bias_activation_fusion"] = args.bias_gelu_fusion
    if args.squared_relu:
        kwargs["activation_func"] = squared_relu
    if args.openai_gelu:
        kwargs["activation_func"] = openai_gelu
    if isinstance(kwargs.get("mamba_training_ssm_states_dtype"), str):
        kwargs["mamba_training_ssm_states_dtype"] = _DTYPE_NAMES[kwargs["mamba_training_ssm_states_dtype"]]
    return config_class(**kwargs)


# Megatron-LM's dtype flags take names; the configs hold torch dtypes (fp8 optimizer states are stored as uint8).
_DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}
_OPTIMIZER_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def core_ddp_config_from_args(args) -> DistributedDataParallelConfig:
    """The DistributedDataParallelConfig of Megatron-LM's ``get_model`` (``--ddp-*``, ``--overlap-*`` and the rest)."""
    kwargs = config_kwargs_from_args(DistributedDataParallelConfig, args, DDP_CONFIG_RENAMES)
    if not getattr(args, "use_megatron_fsdp", False):
        # Megatron-LM's FSDP flags (whose defaults differ from the config's, e.g. the sharding strategy) are read
        # only by Megatron FSDP; plain DDP keeps the config's own values.
        for name in list(kwargs):
            if name == "data_parallel_sharding_strategy" or name.startswith("megatron_fsdp_"):
                del kwargs[name]
    return DistributedDataParallelConfig(**kwargs)


def core_optimizer_config_from_args(args) -> OptimizerConfig:
    """The OptimizerConfig of Megatron-LM's ``get_megatron_optimizer_config``: every field read by name, the dtype
    flags (``--main-grads-dtype fp32``, ...) turned into torch dtypes."""
    kwargs = config_kwargs_from_args(OptimizerConfig, args)
    for name in _OPTIMIZER_DTYPE_FIELDS:
        if isinstance(kwargs.get(name), str):
            kwargs[name] = _DTYPE_NAMES[kwargs[name]]
    return OptimizerConfig(**kwargs)


def get_blend_and_blend_per_split(args) -> Tuple[Optional[tuple], Optional[List[Optional[tuple]]]]:
    """``(blend, blend_per_split)`` from ``--data-path`` / ``--data-args-path`` or the per-split paths / the
    ``--per-split-data-args-path`` JSON file (keys ``train``, ``valid``, ``test``; each a list or a string of
    prefixes, optionally with weights). Both are None for ``--mock-data``."""
    if args.data_args_path is not None:
        with open(args.data_args_path, encoding="utf-8") as stream:
            return get_blend_from_list(stream.read().split()), None
    if args.data_path is not None:
        return get_blend_from_list(args.data_path), None
    if args.per_split_data_args_path is not None:
        path = args.per_split_data_args_path
        with open(path, encoding="utf-8") as stream:
            try:
                per_split = json.load(stream)
            except json.JSONDecodeError as error:
                raise ValueError(f"--per-split-data-args-path {path}: not valid JSON: {error}") from None
        missing = [split for split in ("train", "valid", "test") if split not in per_split]
        if missing:
            raise ValueError(f"--per-split-data-args-path {path}: no {', '.join(missing)} key; give all three")
        lists = [per_split[split] for split in ("train", "valid", "test")]
        return None, [get_blend_from_list(item.split() if isinstance(item, str) else item) for item in lists]
    per_split_paths = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if any(paths is not None for paths in per_split_paths):
        return None, [get_blend_from_list(paths) for paths in per_split_paths]
    return None, None


def core_gpt_dataset_config_from_args(args, tokenizer=None) -> GPTDatasetConfig:
    """The GPTDatasetConfig of ``pretrain_gpt.py`` (``tokenizer`` defaults to the global one, ``get_tokenizer()``)."""
    if tokenizer is None:
        from megatron.training.global_vars import get_tokenizer

        tokenizer = get_tokenizer()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
