"""ModuleSpec / build_module: classes, functions, import paths, params and submodules."""

import pytest
import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module, import_module


class _Recorder(torch.nn.Module):
    def __init__(self, width, scale=1.0, submodules=None):
        super().__init__()
        self.width, self.scale, self.submodules = width, scale, submodules


def test_class_function_and_spec():
    assert isinstance(build_module(IdentityOp), IdentityOp)
    assert build_module(get_bias_dropout_add) is get_bias_dropout_add
    assert build_module(ModuleSpec(module=get_bias_dropout_add)) is get_bias_dropout_add
    built = build_module(ModuleSpec(module=_Recorder, params={"scale": 2.0}, submodules="subs"), 4)
    assert (built.width, built.scale, built.submodules) == (4, 2.0, "subs")
    # call-site keyword arguments win over the spec's params
    assert build_module(ModuleSpec(module=_Recorder, params={"scale": 2.0}), 4, scale=3.0).scale == 3.0


def test_import_path_specs():
    spec = ModuleSpec(module=("megatron.core.transformer.identity_op", "IdentityOp"))
    assert get_module(spec) is IdentityOp
    assert isinstance(build_module(spec), IdentityOp)
    assert import_module(("torch.nn", "Linear")) is torch.nn.Linear


def test_identity_ops():
    x = torch.randn(3)
    assert build_module(IdentityOp)(x, "ignored") is x
    bda = build_module(IdentityFuncOp)(True, False)
    assert bda(x) is x


def test_bad_arguments_name_the_module():
    with pytest.raises(TypeError, match=r"could not build _Recorder from its ModuleSpec: .*unexpected keyword"):
        build_module(ModuleSpec(module=_Recorder, params={"colour": "red"}), 4)
