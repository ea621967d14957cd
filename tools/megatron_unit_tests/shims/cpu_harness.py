"""CPU pieces of the Megatron unit-test harness, shared by both sides (Megatron-Core and this project).

Copied to ``tests/unit_tests/cpu_harness.py`` of the extracted test tree; the conftest there calls
``map_cuda_to_cpu()`` at import and installs ``Recorder`` and ``Mocker``. Nothing here knows which package it runs
against: the same patches apply to both, so a test passes or fails on the package's merits.
"""

import functools
import json
import os
import signal
import sys
import time
import typing
from unittest import mock

import pytest
import torch

# Ceiling of one test; a test past it fails with TimeoutError (single-process gloo never blocks in C++).
TEST_TIMEOUT_S = int(os.environ.get("MLM_UT_TEST_TIMEOUT", "180"))


def _cpu(device):
    is_cuda = isinstance(device, int) or (device is not None and torch.device(device).type == "cuda")
    return "cpu" if is_cuda else device


def _is_device(value) -> bool:
    return isinstance(value, (str, torch.device)) or (isinstance(value, int) and not isinstance(value, bool))


def _with_cpu_device(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return factory(*args, **kwargs)

    return make


class _NoStream:
    """CPU work is synchronous: there is nothing to wait for or record."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_event(self, *args):
        pass

    def wait_stream(self, *args):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args):
        return _NoEvent()


class _NoEvent(_NoStream):
    def record(self, *args):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def map_cuda_to_cpu() -> None:
    """Send tensors asked for on ``'cuda'`` to the CPU; CUDA streams, events and syncs become no-ops.

    ``torch.cuda.is_available()`` stays False, so tests that skip without a GPU skip on both sides.
    """
    factories = ("tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "randperm")
    factories += ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "linspace", "eye")
    for name in factories:
        setattr(torch, name, _with_cpu_device(getattr(torch, name)))
    tensor_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        args = tuple(_cpu(a) if _is_device(a) else a for a in args)
        kwargs = {k: _cpu(v) if k == "device" else v for k, v in kwargs.items()}
        return tensor_to(self, *args, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory.empty_cache = lambda: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.default_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.stream = lambda *args, **kwargs: _NoStream()
    # The CUDA generator is the CPU one here (torch.cuda.manual_seed and set_rng_state queue lazily and never run).
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state


def provide_newer_python_names() -> None:
    """Megatron-LM 0.19 targets Python 3.12 (``typing.override``) and some tests import the ``mock`` backport."""
    if not hasattr(typing, "override"):
        typing.override = lambda method: method
    sys.modules.setdefault("mock", mock)


def _first_error_line(report) -> str:
    """The exception line of a failure (for an import error, the one naming what is missing)."""
    if report.passed or report.longrepr is None:
        return ""
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[2])[:300]
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        text = crash.message
    else:  # a collection error: the ``E   `` lines of its text, the last one names the exception
        marked = [line[1:] for line in str(report.longrepr).splitlines() if line.startswith("E ")]
        text = marked[-1] if marked else str(report.longrepr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


class Recorder:
    """Appends one JSON line per finished test to $MLM_UT_RESULTS, so a killed run keeps what it finished."""

    def __init__(self, path: str):
        self.path = path

    def _write(self, record):
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._write({"nodeid": item.nodeid, "outcome": "started", "time": time.time()})
        yield

    def pytest_runtest_logreport(self, report):
        failed_setup = report.when == "setup" and not report.passed
        if report.when == "call" or failed_setup:
            self._write({"nodeid": report.nodeid, "outcome": report.outcome, "error": _first_error_line(report)})

    def pytest_collectreport(self, report):
        if report.failed:
            self._write({"nodeid": report.nodeid, "outcome": "collect-error", "error": _first_error_line(report)})


class _Timeout:
    """Fails a test that runs past TEST_TIMEOUT_S (SIGALRM, main thread only)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        def expire(signum, frame):
            raise TimeoutError(f"test ran past {TEST_TIMEOUT_S} s (harness limit)")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.alarm(TEST_TIMEOUT_S)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


timeout_plugin = _Timeout()


class Mocker:
    """The part of pytest-mock's ``mocker`` fixture Megatron's tests use, on ``unittest.mock``."""

    Mock, MagicMock, PropertyMock, ANY, call, sentinel = (
        mock.Mock,
        mock.MagicMock,
        mock.PropertyMock,
        mock.ANY,
        mock.call,
        mock.sentinel,
    )

    def __init__(self):
        self._patches = []
        mocker = self

        class _Patch:
            def __call__(self, target, *args, **kwargs):
                return mocker._start(mock.patch(target, *args, **kwargs))

            def object(self, target, attribute, *args, **kwargs):
                return mocker._start(mock.patch.object(target, attribute, *args, **kwargs))

            def dict(self, in_dict, values=(), clear=False, **kwargs):
                return mocker._start(mock.patch.dict(in_dict, values, clear, **kwargs))

            def multiple(self, target, **kwargs):
                return mocker._start(mock.patch.multiple(target, **kwargs))

        self.patch = _Patch()

    def _start(self, patcher):
        started = patcher.start()
        self._patches.append(patcher)
        return started

    def spy(self, obj, name):
        original = getattr(obj, name)
        if isinstance(obj, type):  # a method on a class: autospec keeps ``self`` in the call
            return self._start(mock.patch.object(obj, name, side_effect=original, autospec=True))
        return self._start(mock.patch.object(obj, name, wraps=original))

    def stub(self, name=None):
        return mock.MagicMock(spec=lambda *args, **kwargs: None, name=name)

    def stopall(self):
        for patcher in reversed(self._patches):
            patcher.stop()
        self._patches.clear()
