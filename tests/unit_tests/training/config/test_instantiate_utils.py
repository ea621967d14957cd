"""instantiate: building objects from _target_ dicts, and the allow-list that refuses unknown targets."""

import enum
import functools
import logging
import os
import sys

import numpy as np
import pytest
import torch

from megatron.core.optimizer import OptimizerConfig
from megatron.training.config.instantiate_utils import (
    InstantiationException,
    InstantiationMode,
    TargetAllowlist,
    _locate,
    instantiate,
    target_allowlist,
)

OPTIMIZER = "megatron.core.optimizer.OptimizerConfig"


class Colour(enum.Enum):
    RED = "red"


@pytest.fixture
def allow_this_module():
    target_allowlist.add_prefix(f"{__name__}.")
    yield
    target_allowlist.remove_prefix(f"{__name__}.")


def test_refused_target_is_never_imported():
    with pytest.raises(InstantiationException) as error:
        instantiate({"run": {"_target_": "untrusted_pkg_xyz.payload.run"}})
    message = str(error.value)
    assert "Target 'untrusted_pkg_xyz.payload.run' is not in the allowlist" in message
    assert "target_allowlist.add_prefix('untrusted_pkg_xyz.payload.')" in message
    assert "target_allowlist.add_exact('untrusted_pkg_xyz.payload.run')" in message
    assert "megatron.training., megatron.core." in message
    assert message.endswith("full_key: run")
    assert "untrusted_pkg_xyz" not in sys.modules


def test_refusal_covers_callables_given_in_code_and_os_system():
    # os.system's own module is posix (or nt): the path a callable is written as is where it is defined.
    with pytest.raises(InstantiationException, match=f"'{os.system.__module__}.system' is not in the allowlist"):
        instantiate({"_target_": os.system, "command": "true"})
    with pytest.raises(InstantiationException, match="not in the allowlist"):
        instantiate({"_target_": "builtins.eval", "_args_": ["1"]})


def test_allowlist_prefix_must_end_with_a_dot_and_removal_must_exist():
    allowlist = TargetAllowlist()
    with pytest.raises(ValueError, match=r"Prefix must end with '\.': got 'custom'; write 'custom\.'"):
        allowlist.add_prefix("custom")
    with pytest.raises(ValueError, match="Prefix 'custom.' is not in the allowlist"):
        allowlist.remove_prefix("custom.")
    assert not allowlist.is_allowed("torchvision.models.resnet50")


def test_builds_nested_targets_with_strict_checking():
    built = instantiate({"_target_": OPTIMIZER, "lr": 0.5, "weight_decay": 0.0}, mode=InstantiationMode.STRICT)
    assert isinstance(built, OptimizerConfig) and built.lr == 0.5 and built.weight_decay == 0.0
    nested = instantiate({"outer": [{"_target_": OPTIMIZER, "lr": 0.25}], "plain": 3})
    assert nested["outer"][0].lr == 0.25 and nested["plain"] == 3


def test_unexpected_keys_strict_error_and_lenient_warning(caplog):
    config = {"_target_": OPTIMIZER, "lr": 0.5, "not_a_field": 1}
    with pytest.raises(
        InstantiationException, match=r"Unexpected config keys for target .*OptimizerConfig': \['not_a_field'\]"
    ):
        instantiate(config, mode=InstantiationMode.STRICT)
    with caplog.at_level(logging.WARNING):
        built = instantiate(config)
    assert built.lr == 0.5
    assert "Dropping unexpected config keys" in caplog.text and "not_a_field" in caplog.text


def test_partial_call_args_and_kwargs_override():
    relu = instantiate({"_target_": "torch.nn.functional.relu", "_call_": False})
    assert relu is torch.nn.functional.relu
    part = instantiate({"_target_": "torch.full", "_partial_": True, "fill_value": 2.0})
    assert isinstance(part, functools.partial) and part((2,)).tolist() == [2.0, 2.0]
    later = instantiate({"_target_": "torch.full", "_partial_": True, "fill_value": "???"})
    assert "fill_value" not in later.keywords  # "???" marks a value the caller supplies
    # Values that are not strings are never "???" (an array compared with a string has no single truth value).
    with_array = instantiate({"_target_": "torch.as_tensor", "_partial_": True, "data": np.ones(2)})
    assert with_array().tolist() == [1.0, 1.0]
    assert instantiate({"_target_": "torch.zeros", "_args_": [3]}).shape == (3,)
    assert instantiate({"_target_": "torch.zeros", "_args_": [3]}, 2).shape == (2,)
    assert instantiate({"_target_": OPTIMIZER, "lr": 0.5}, lr=0.125).lr == 0.125


def test_enum_and_dtype_targets(allow_this_module):
    assert instantiate({"_target_": f"{__name__}.Colour", "_args_": ["red"], "_name_": "RED"}) is Colour.RED
    assert instantiate({"_target_": "torch.bfloat16", "_call_": False}) is torch.bfloat16


@pytest.mark.parametrize(
    "config, error, message",
    [
        (
            {"_target_": "torch.float32", "_call_": False, "x": 1},
            InstantiationException,
            "_call_ was set to False for target.*extra keys were found",
        ),
        (
            {"_target_": "torch.zeros", "_partial_": "yes"},
            TypeError,
            "_partial_ flag must be a bool \\(true or false\\), got 'yes'",
        ),
        ({"_target_": "torch.zeros", "_args_": 3}, InstantiationException, "Unsupported _args_ type: 'int'"),
        ({"_target_": "torch.float32"}, InstantiationException, "Expected a callable target.*_call_: false"),
        ({"a": {"_target_": "torch.no_such_thing"}}, InstantiationException, "Error locating target 'torch.no_such"),
        ({"b": {"_target_": "torch.zeros", "bad": 1}}, InstantiationException, "Error in call to target"),
    ],
)
def test_bad_nodes_name_the_problem(config, error, message):
    with pytest.raises(error, match=message):
        instantiate(config)


def test_failure_reports_the_nested_key():
    with pytest.raises(InstantiationException, match=r"full_key: a\.b\.1"):
        instantiate({"a": {"b": [1, {"_target_": "os.getcwd"}]}})


def test_top_level_must_be_a_dict_or_list():
    assert instantiate(None) is None
    with pytest.raises(InstantiationException, match="Cannot instantiate config of type str"):
        instantiate("torch.zeros")
    with pytest.raises(InstantiationException, match="_partial_ keyword is not compatible with top-level list"):
        instantiate([{"_target_": "torch.zeros", "_args_": [1]}], _partial_=True)


def test_locate_errors():
    with pytest.raises(ImportError, match="Empty path"):
        _locate("")
    with pytest.raises(ValueError, match="Relative imports are not supported"):
        _locate(".relative.name")
    with pytest.raises(ImportError, match="Unable to import any module in the path"):
        _locate("no_such_package_xyz.thing")
    with pytest.raises(ImportError, match="Are you sure that 'nope' is an attribute of 'torch.nn'"):
        _locate("torch.nn.nope")
    assert _locate("torch.nn.Linear.forward") is torch.nn.Linear.forward


@pytest.mark.parametrize(
    "path, origin",
    [
        ("megatron.training.config.container.os.system", "posix.system"),
        ("megatron.training.config.utils.importlib.import_module", "importlib.import_module"),
        ("megatron.training.config.container.yaml.load", "yaml.load"),
        ("megatron.training.config.container.copy", "copy."),
    ],
)
def test_names_imported_into_an_allowed_module_are_refused(path, origin):
    origin = origin.replace("posix", os.system.__module__)
    with pytest.raises(InstantiationException, match=f"'{origin}' imported into an allowed module.*add_exact"):
        instantiate({"_target_": path, "_call_": False})


def test_a_config_cannot_switch_the_allowlist_off():
    config = {
        "off": {"_target_": "megatron.training.config.instantiate_utils.target_allowlist.disable"},
        "run": {"_target_": "untrusted_pkg_xyz.run"},
    }
    with pytest.raises(InstantiationException, match="which configs may not call or reference\nfull_key: off"):
        instantiate(config)
    assert target_allowlist.enabled
    with pytest.raises(InstantiationException, match="may not call or reference"):
        instantiate({"_target_": "megatron.training.config.instantiate_utils._locate", "path": "os"})


def test_exact_entries_are_trusted_as_written():
    target_allowlist.add_exact("os.getcwd")
    try:
        assert instantiate({"_target_": "os.getcwd"}) == os.getcwd()
    finally:
        target_allowlist.remove_exact("os.getcwd")
