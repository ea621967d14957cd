"""The harness's conftest, in place of Megatron's ``tests/unit_tests/conftest.py`` (same fixtures, CPU only).

It maps CUDA devices to the CPU before any test module is imported (and gives Python 3.11 ``typing.override``),
records each result as a JSON line ($MLM_UT_RESULTS), bounds each test's time, and provides the fixtures Megatron's
tests ask for: ``experimental``, ``set_env``, ``reset_env_vars``, ``tmp_path_dist_ckpt`` and ``mocker`` (the part
of pytest-mock's that they use).
"""

import os
from pathlib import Path

import pytest
import torch

from tests.unit_tests import cpu_harness

cpu_harness.map_cuda_to_cpu()
cpu_harness.provide_newer_python_names()

from tests.unit_tests.test_utilities import Utils  # noqa: E402  (after the CUDA mapping)


def pytest_addoption(parser):
    parser.addoption("--experimental", action="store_true", help="set megatron.core.config.ENABLE_EXPERIMENTAL")


def pytest_configure(config):
    config.pluginmanager.register(cpu_harness.timeout_plugin, "mlm-ut-timeout")
    if os.environ.get("MLM_UT_RESULTS"):
        config.pluginmanager.register(cpu_harness.Recorder(os.environ["MLM_UT_RESULTS"]), "mlm-ut-recorder")


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK


@pytest.fixture(autouse=True)
def experimental(request):
    try:
        from megatron.core import config
    except ImportError:
        return
    config.ENABLE_EXPERIMENTAL = request.config.getoption("--experimental") is True


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def set_env():
    # Transformer Engine is absent on both sides; these only keep the environment Megatron's tests expect.
    os.environ["NVTE_FLASH_ATTN"] = "0"
    os.environ["NVTE_FUSED_ATTN"] = "0"


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tmp_dist_ckpt")


@pytest.fixture(autouse=True)
def reset_env_vars():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Always this one, so both sides get the same fixture whether or not pytest-mock is installed for one of them.
@pytest.fixture
def mocker():
    helper = cpu_harness.Mocker()
    yield helper
    helper.stopall()


__all__ = ["Utils"]
