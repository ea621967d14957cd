"""The optional Transformer Engine / apex FusedAdam is found when installed and used for CUDA parameters only."""

import sys
import types

import pytest
import torch

from megatron.core.extensions.fused_adam import find_fused_adam
from megatron.core.optimizer import OptimizerConfig, _build_torch_optimizer


class _FakeFusedAdam(torch.optim.Adam):
    def __init__(self, params, adam_w_mode=True, **kwargs):
        self.adam_w_mode = adam_w_mode
        super().__init__(params, **kwargs)


def _install(monkeypatch, module_name):
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setattr(sys.modules[module_name], "FusedAdam", _FakeFusedAdam, raising=False)


def test_none_without_the_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "apex", None)
    assert find_fused_adam() is None


@pytest.mark.parametrize("module_name", ["apex.optimizers", "transformer_engine.pytorch.optimizers"])
def test_found_when_installed(monkeypatch, module_name):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "apex", None)
    _install(monkeypatch, module_name)
    assert find_fused_adam() is _FakeFusedAdam


def test_cpu_parameters_keep_torch_adam_even_when_installed(monkeypatch):
    _install(monkeypatch, "apex.optimizers")
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = _build_torch_optimizer(OptimizerConfig(lr=1e-3), [{"params": [param]}])
    assert type(optimizer) is torch.optim.AdamW


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parameters_use_the_extension(monkeypatch):
    _install(monkeypatch, "apex.optimizers")
    param = torch.nn.Parameter(torch.zeros(3, device="cuda"))
    optimizer = _build_torch_optimizer(OptimizerConfig(lr=1e-3, decoupled_weight_decay=False), [{"params": [param]}])
    assert isinstance(optimizer, _FakeFusedAdam) and optimizer.adam_w_mode is False
