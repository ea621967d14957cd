"""safe_yaml_representers: what it writes for non-YAML values, and that it leaves the SafeDumper as it was."""

import functools

import pytest
import torch
import yaml

from megatron.training.config.yaml_utils import safe_yaml_representers


class Plain:
    pass


def scale(x, factor=1.0):
    return x * factor


def test_representers_are_removed_on_exit():
    before = (dict(yaml.SafeDumper.yaml_representers), dict(yaml.SafeDumper.yaml_multi_representers))
    with safe_yaml_representers():
        yaml.safe_dump({"f": torch.zeros})
    assert (yaml.SafeDumper.yaml_representers, yaml.SafeDumper.yaml_multi_representers) == before
    with pytest.raises(yaml.representer.RepresenterError):
        yaml.safe_dump({"f": torch.zeros})


def test_written_forms():
    with safe_yaml_representers():
        data = yaml.safe_load(
            yaml.safe_dump(
                {
                    "cls": torch.nn.Linear,
                    "obj": Plain(),
                    "dtype": torch.float16,
                    "part": functools.partial(scale, 2, factor=1.5),
                }
            )
        )
    assert data["cls"] == {"_target_": "torch.nn.modules.linear.Linear", "_call_": False}
    assert data["obj"] == {"_target_": f"{__name__}.Plain", "_call_": True}
    assert data["dtype"] == {"_target_": "torch.float16", "_call_": False}
    assert data["part"] == {"_target_": f"{__name__}.scale", "_partial_": True, "_args_": [2], "factor": 1.5}
