"""ArgumentGroupFactory (flags generated from a config dataclass), pretrain_cfg_container_from_args and the
evaluation sample counts of get_train_valid_test_num_samples."""

import argparse
import enum
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Literal, Optional, Union
from unittest import mock

import pytest

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.training import global_vars
from megatron.training import argument_utils
from megatron.training.argument_utils import ArgumentGroupFactory, TypeInferenceError
from megatron.training.config_from_args import pretrain_cfg_container_from_args
from megatron.training.config import PretrainConfigContainer, ValidationConfig
from megatron.training.training import get_train_valid_test_num_samples


class Color(enum.Enum):
    red = 1
    blue = 2


@dataclass
class Sample:
    """A sample config."""

    size: int = 3
    """How many."""

    ratio: Optional[float] = None
    """A fraction."""

    names: list[str] = field(default_factory=lambda: ["a"])
    """Some names."""

    mode: Literal["x", "y"] = "x"
    """Which mode."""

    color: Color = Color.red
    """A color."""

    verbose: bool = False
    """Talk more."""

    fused: bool = True
    """Fuse kernels."""

    hidden: int = field(default=0, init=False)


@dataclass
class WithCallable:
    hook: Optional[Callable] = None


@dataclass
class WithUnion:
    value: Union[int, str] = 0


def _parser(config_class, **factory_kwargs):
    parser = argparse.ArgumentParser(exit_on_error=False)
    group = ArgumentGroupFactory(config_class, **factory_kwargs).build_group(parser, title="sample")
    return parser, group


def test_flags_types_and_defaults_follow_the_fields():
    parser, group = _parser(Sample)
    assert group.title == "sample" and group.description == "A sample config."
    defaults = parser.parse_args([])
    assert (defaults.size, defaults.ratio, defaults.names, defaults.mode) == (3, None, ["a"], "x")
    assert (defaults.color, defaults.verbose, defaults.fused) == (Color.red, False, True)
    assert not hasattr(defaults, "hidden")  # init=False fields get no flag
    args = parser.parse_args(
        ["--size", "5", "--ratio", "0.5", "--names", "p", "q", "--mode", "y", "--color", "blue", "--verbose"]
    )
    assert (args.size, args.ratio, args.names, args.mode, args.color, args.verbose) == (
        5,
        0.5,
        ["p", "q"],
        "y",
        Color.blue,
        True,
    )
    assert parser.parse_args(["--no-fused"]).fused is False
    assert parser.parse_args(["--disable-fused"]).fused is False


def test_help_is_the_field_docstring():
    parser, _ = _parser(Sample)
    helps = {action.dest: action.help for action in parser._actions}
    assert helps["size"] == "How many." and helps["fused"] == "Fuse kernels."


def test_excluded_fields_get_no_flag():
    parser, _ = _parser(Sample, exclude=["size", "color"])
    args = parser.parse_args([])
    assert not hasattr(args, "size") and not hasattr(args, "color") and hasattr(args, "ratio")


def test_unknown_enum_member_names_the_choices():
    parser, _ = _parser(Sample)
    with pytest.raises(KeyError, match="'green' is not a member of Color; choose from red, blue"):
        parser.parse_args(["--color", "green"])


def test_literal_rejects_other_values():
    parser, _ = _parser(Sample)
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--mode", "z"])


@pytest.mark.parametrize(
    "config_class, message",
    [
        (WithCallable, r"WithCallable\.hook: Unsupported type: .*Callable.*argparse_meta"),
        (WithUnion, r"WithUnion\.value: Unions not supported by argparse: .*exclude it"),
    ],
)
def test_a_type_argparse_cannot_parse_names_the_field_and_the_fix(config_class, message):
    with pytest.raises(TypeInferenceError, match=message):
        _parser(config_class)


def test_argparse_meta_overrides_what_is_inferred():
    @dataclass
    class Meta:
        level: Union[int, str] = field(default=1, metadata={"argparse_meta": {"type": int, "arg_names": ["--lvl"]}})
        tag: str = field(default="a", metadata={"argparse_meta": {"dest": "label", "default": "b"}})

    parser, _ = _parser(Meta)
    assert parser.parse_args(["--lvl", "4"]).level == 4
    assert parser.parse_args([]).label == "b"


def test_mixed_literal_is_refused():
    factory = ArgumentGroupFactory(Sample)
    with pytest.raises(TypeInferenceError, match="Literal choices of mixed types"):
        factory._extract_type(Literal["a", 1])


def test_validation_config_flags():
    parser = argparse.ArgumentParser()
    ArgumentGroupFactory(ValidationConfig).build_group(parser, "validation")
    args = parser.parse_args(["--start-eval-at-iter", "7", "--eval-global-batch-size", "16"])
    assert args.start_eval_at_iter == 7 and args.eval_global_batch_size == 16 and args.eval_micro_batch_size is None


def _container_args(**overrides):
    values = dict(
        no_save_optim=True,
        no_save_rng=False,
        no_load_optim=False,
        no_load_rng=True,
        ckpt_fully_parallel_save=False,
        ckpt_fully_parallel_load=True,
        profile=True,
        check_for_nan_in_loss_and_grad=False,
        train_iters=9,
        save="/tmp/ckpt",
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def test_pretrain_container_maps_negated_and_renamed_flags():
    optimizer, ddp = OptimizerConfig(lr=0.5), DistributedDataParallelConfig()
    with (
        mock.patch("megatron.training.training.get_megatron_optimizer_config", return_value=optimizer),
        mock.patch("megatron.training.training.get_megatron_ddp_config", return_value=ddp),
        pytest.warns(UserWarning, match="without model_cfg"),
    ):
        container = pretrain_cfg_container_from_args(_container_args())
    assert isinstance(container, PretrainConfigContainer)
    assert container.optimizer is optimizer and container.ddp is ddp and container.model is None
    checkpoint = container.checkpoint
    assert (checkpoint.save_optim, checkpoint.save_rng, checkpoint.load_optim, checkpoint.load_rng) == (
        False,
        True,
        True,
        False,
    )
    assert (checkpoint.fully_parallel_save, checkpoint.fully_parallel_load, checkpoint.save) == (
        False,
        True,
        "/tmp/ckpt",
    )
    assert container.profiling.use_nsys_profiler is True
    assert container.rerun_state_machine.check_for_nan_in_loss is False
    assert container.train.train_iters == 9


def test_pretrain_container_accepts_megatron_optimizer_config_pair():
    optimizer = OptimizerConfig(lr=0.5)
    with (
        mock.patch("megatron.training.training.get_megatron_optimizer_config", return_value=(optimizer, {})),
        mock.patch("megatron.training.training.get_megatron_ddp_config", return_value=DistributedDataParallelConfig()),
    ):
        container = pretrain_cfg_container_from_args(_container_args(), model_cfg=object())
    assert container.optimizer is optimizer


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({}, (3200, 11 * 5 * 32, 5 * 32)),
        ({"eval_global_batch_size": 16}, (3200, 11 * 5 * 16, 5 * 16)),
        ({"skip_train": True, "eval_global_batch_size": 8}, (3200, 5 * 8, 5 * 8)),
        ({"start_eval_at_iter": 45}, (3200, 7 * 5 * 32, 5 * 32)),
    ],
)
def test_num_samples_count_evaluation_batches(overrides, expected):
    args = SimpleNamespace(
        train_samples=None, train_iters=100, global_batch_size=32, eval_interval=10, eval_iters=5, **overrides
    )
    previous = global_vars._GLOBAL_ARGS
    global_vars._GLOBAL_ARGS = args
    try:
        assert get_train_valid_test_num_samples() == expected
    finally:
        global_vars._GLOBAL_ARGS = previous


def test_container_builders_are_importable_from_megatron_path():
    assert argument_utils.pretrain_cfg_container_from_args is pretrain_cfg_container_from_args
    with pytest.raises(AttributeError, match="has no attribute 'no_such_builder'"):
        argument_utils.no_such_builder
