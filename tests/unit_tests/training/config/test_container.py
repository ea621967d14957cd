"""ConfigContainerBase: to_dict/from_dict and to_yaml/from_yaml round trips, and their errors."""

import copy
import enum
import functools
import importlib.util
import re
from dataclasses import dataclass, field

import pytest
import torch
import yaml

from megatron.core.optimizer import OptimizerConfig
from megatron.training.config.container import ConfigContainerBase, _Interpolator
from megatron.training.config.instantiate_utils import InstantiationException, InstantiationMode, target_allowlist


class Phase(enum.Enum):
    WARMUP = "warmup"
    DECAY = "decay"


def scale(x, factor=1.0):
    return x * factor


@dataclass
class Inner:
    phase: Phase = Phase.DECAY
    dtype: torch.dtype = torch.bfloat16
    activation: object = torch.nn.functional.gelu
    scaler: object = field(default_factory=lambda: functools.partial(scale, factor=2.0))


@dataclass(kw_only=True)
class Run(ConfigContainerBase):
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    inner: Inner = field(default_factory=Inner)
    tags: list = field(default_factory=list)
    steps: int = 10
    post_init_calls: int = field(init=False, default=0)

    def __post_init__(self):
        self.post_init_calls += 1


@pytest.fixture
def allow_this_module():
    target_allowlist.add_prefix(f"{__name__}.")
    yield
    target_allowlist.remove_prefix(f"{__name__}.")


def test_dict_round_trip(allow_this_module):
    run = Run(optimizer=OptimizerConfig(lr=0.01), tags=["a", Inner(phase=Phase.WARMUP)], steps=3)
    data = run.to_dict()
    assert data["_target_"] == f"{__name__}.Run"
    assert data["optimizer"]["_target_"] == "megatron.core.optimizer.optimizer_config.OptimizerConfig"
    assert data["tags"][1]["_target_"] == f"{__name__}.Inner"
    back = Run.from_dict(data)
    assert back.optimizer.lr == 0.01 and back.steps == 3 and back.tags[1].phase is Phase.WARMUP
    assert "post_init_calls" in data and back.post_init_calls == 1  # the saved computed field was dropped


def test_yaml_round_trip_of_functions_enums_dtypes_and_partials(tmp_path, allow_this_module):
    path = str(tmp_path / "run.yaml")
    Run(steps=7).to_yaml(path)
    text = open(path).read()
    assert "_target_: torch.bfloat16" in text and "_partial_: true" in text
    back = Run.from_yaml(path)
    assert back.steps == 7
    assert back.inner.phase is Phase.DECAY and back.inner.dtype is torch.bfloat16
    assert back.inner.activation is torch.nn.functional.gelu
    assert back.inner.scaler(3.0) == 6.0


def test_yaml_naming_an_unlisted_target_is_refused(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("_target_: megatron.training.config.container.ConfigContainerBase\n")
    assert isinstance(ConfigContainerBase.from_yaml(str(path)), ConfigContainerBase)
    path.write_text(f"_target_: {__name__}.Run\nsteps: 1\n")
    with pytest.raises(InstantiationException, match=f"Target '{__name__}.Run' is not in the allowlist"):
        Run.from_yaml(str(path))


def test_from_dict_errors(allow_this_module):
    with pytest.raises(AssertionError, match=f"the dict has no '_target_' key; add '_target_: {__name__}.Run'"):
        Run.from_dict({"steps": 1})
    with pytest.raises(TypeError, match="Run.from_dict needs a dict with a '_target_' key, got list"):
        Run.from_dict([])
    data = {"_target_": f"{__name__}.Run", "steps": 2, "stale": 1}
    with pytest.raises(ValueError, match=r"Dictionary contains extra keys not in Run: \['stale'\]"):
        Run.from_dict(data)
    assert Run.from_dict(data, mode=InstantiationMode.LENIENT).steps == 2
    assert data["stale"] == 1  # the caller's dict is left alone
    optimizer = {"_target_": "megatron.core.optimizer.OptimizerConfig", "lr": 0.1}
    with pytest.raises(TypeError, match="Run.from_dict: '_target_: megatron.core.optimizer.OptimizerConfig' built"):
        Run.from_dict(optimizer, mode=InstantiationMode.LENIENT)


def test_from_yaml_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="YAML file not found: .*missing.yaml"):
        Run.from_yaml(str(tmp_path / "missing.yaml"))
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n")
    with pytest.raises(ValueError, match="list.yaml: the file must hold a mapping with a '_target_' key, not list"):
        Run.from_yaml(str(listing))
    with pytest.raises(ValueError, match="msc:// object-store paths are not supported"):
        Run.from_yaml("msc://bucket/run.yaml")
    with pytest.raises(ValueError, match="msc:// object-store paths are not supported"):
        Run().to_yaml("msc://bucket/run.yaml")


def test_interpolations_without_omegaconf(monkeypatch):
    monkeypatch.setenv("DATA_ROOT", "/data")
    monkeypatch.delenv("UNSET_VAR_XYZ", raising=False)
    config = {
        "steps": 4,
        "sizes": [8, "${steps}"],
        "name": "run-${steps}-${sizes.0}",
        "path": "${oc.env:DATA_ROOT}/train",
        "fallback": "${oc.env:UNSET_VAR_XYZ,none_set}",
        "nothing": "${oc.env:UNSET_VAR_XYZ,null}",
        "chain": "${sizes.1}",
    }
    resolved = _Interpolator(config, "run.yaml").resolve(config)
    assert resolved["sizes"] == [8, 4] and resolved["chain"] == 4  # a whole-string reference keeps its type
    assert resolved["name"] == "run-4-8" and resolved["path"] == "/data/train"
    assert resolved["fallback"] == "none_set" and resolved["nothing"] is None


@pytest.mark.parametrize(
    "config, message",
    [
        ({"a": "${missing.key}"}, "key 'a': '${missing.key}' refers to a key that is not in the file"),
        ({"a": ["${oc.env:UNSET_VAR_XYZ}"]}, "key 'a.0': environment variable 'UNSET_VAR_XYZ' is not set"),
        ({"a": "${oc.select:b}"}, "key 'a': '${oc.select:b}' is not supported without omegaconf"),
        ({"a": "${.b}"}, "key 'a': '${.b}' is not supported without omegaconf"),
        ({"a": "${b}", "b": "${a}"}, "key 'a': '${b}' refers back to itself"),
    ],
)
def test_interpolation_errors_name_the_key(config, message, monkeypatch):
    monkeypatch.delenv("UNSET_VAR_XYZ", raising=False)
    with pytest.raises(ValueError, match="^run.yaml: " + re.escape(message)):
        _Interpolator(config, "run.yaml").resolve(config)


@pytest.mark.skipif(importlib.util.find_spec("omegaconf") is not None, reason="omegaconf resolves interpolations")
def test_from_yaml_resolves_interpolations(tmp_path, allow_this_module):
    path = tmp_path / "interp.yaml"
    path.write_text(f"_target_: {__name__}.Run\nsteps: 3\ntags: [x, '${{steps}}']\n")
    assert Run.from_yaml(str(path)).tags == ["x", 3]


def test_print_yaml_and_deepcopy(capsys):
    run = Run(steps=5)
    run.print_yaml()
    assert yaml.safe_load(capsys.readouterr().out)["steps"] == 5
    copied = copy.deepcopy(run)
    assert copied.optimizer is not run.optimizer and copied.steps == 5
    assert copied.post_init_calls == 1  # __post_init__ did not run again
