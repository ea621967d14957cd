"""Timers: log levels, start/stop/elapsed on a driven clock, the three report layouts, writers, and the min/max
across real gloo ranks."""

import pytest

from megatron.training import timers as timers_module
from megatron.training.timers import DummyTimer, Timer, Timers
from tests.unit_tests.test_utilities import run_distributed


@pytest.fixture
def clock(monkeypatch):
    """A clock the test moves by hand: ``clock.now = 2.5``."""

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    fake = Clock()
    monkeypatch.setattr(timers_module, "_clock", fake)
    return fake


def test_timers_above_the_log_level_are_dummies():
    timers = Timers(1, "max")
    assert isinstance(timers("iteration", log_level=0), Timer)
    assert isinstance(timers("optimizer", log_level=1), Timer)
    assert isinstance(timers("inner"), DummyTimer)  # no level given: the finest, 2
    assert timers("iteration") is timers("iteration", log_level=0)
    with pytest.raises(ValueError, match="timer 'iteration' was created with log level 0, asked for 1"):
        timers("iteration", log_level=1)
    with pytest.raises(ValueError, match=r"timer 'x': log level must be in 0..2, got 3"):
        timers("x", log_level=3)
    with pytest.raises(RuntimeError, match="raise --timing-log-level"):
        timers("inner").elapsed()


@pytest.mark.parametrize(
    "level, option, message",
    [
        (0, "median", "timing log option 'median' is not one of"),
        (3, "max", r"timing log level must be in 0..2, got 3"),
    ],
)
def test_bad_timer_settings(level, option, message):
    with pytest.raises(ValueError, match=message):
        Timers(level, option)


def test_start_stop_elapsed_and_active_time(clock):
    timer = Timer("step")
    timer.start()
    clock.now = 2.0
    timer.stop()
    timer.start()
    clock.now = 3.0
    assert timer.elapsed(reset=False) == 3.0  # a running timer is read without stopping it
    clock.now = 4.0
    assert timer.elapsed() == 4.0
    clock.now = 5.0
    timer.stop()
    assert timer.elapsed() == 1.0  # counted again from the reset
    assert timer.active_time() == 5.0  # resets do not touch the total


def test_start_and_stop_out_of_order():
    timer = Timer("step")
    with pytest.raises(RuntimeError, match="timer 'step' is not started; start it first"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="timer 'step' has already been started; stop it first"):
        timer.start()


def timers_with(option, **seconds):
    timers = Timers(2, option)
    for name, value in seconds.items():
        timers(name, log_level=0).set_elapsed(value)
    return timers


def test_report_layouts():
    name = "forward-backward "
    assert timers_with("max", **{"forward-backward": 0.25}).get_all_timers_string(["forward-backward"]) == (
        "max time across ranks (ms):\n    " + name.ljust(48, ".") + ": 250.00"
    )
    assert timers_with("minmax", **{"forward-backward": 0.25}).get_all_timers_string(normalizer=2.0) == (
        "(min, max) time across ranks (ms):\n    " + name.ljust(48, ".") + ": (125.00, 125.00)"
    )
    assert timers_with("all", fwd=0.5).get_all_timers_string(["fwd"]) == (
        "times across ranks (ms):\n  fwd:\n     rank  0: 500.00"
    )


def test_reset_and_timers_that_did_not_run():
    timers = timers_with("minmax", fwd=0.5, idle=0.0)
    assert "idle" not in timers.get_all_timers_string(["fwd", "idle", "never-created"], reset=False)
    assert timers.get_all_timers_string(["fwd"]) is not None
    assert timers.get_all_timers_string(["fwd"]) is None  # the first report reset it
    with pytest.raises(ValueError, match="normalizer must be positive, got 0"):
        timers.get_all_timers_string(["fwd"], normalizer=0)


def test_log_prints_on_the_chosen_rank(capsys):
    timers_with("max", fwd=0.5).log(["fwd"])
    assert "fwd" in capsys.readouterr().out
    timers_with("max", fwd=0.5).log(["fwd"], rank=1)  # no rank 1 in a single process: nothing printed
    assert capsys.readouterr().out == ""


class FakeTensorBoard:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))


class FakeWandb:
    def __init__(self):
        self.logged = []

    def log(self, values, step):
        self.logged.append((values, step))


def test_write_sends_the_max_to_tensorboard_or_wandb():
    tensorboard, wandb = FakeTensorBoard(), FakeWandb()
    timers_with("minmax", fwd=0.5).write(["fwd"], tensorboard, iteration=3, normalizer=2.0)
    timers_with("minmax", fwd=0.5).write(["fwd"], wandb, iteration=4)
    timers_with("minmax", fwd=0.5).write(["fwd"], None, iteration=5)
    assert tensorboard.scalars == [("fwd-time", 0.25, 3)]
    assert wandb.logged == [({"fwd-time": 0.5}, 4)]


def _report_from_two_ranks():
    import torch.distributed as dist

    results = {}
    for option in ("minmax", "all"):
        timers = Timers(0, option)
        timers("step", log_level=0).set_elapsed(0.1 * (dist.get_rank() + 1))
        if dist.get_rank() == 1:
            timers("only-on-rank-1", log_level=0).set_elapsed(0.3)
        results[option] = timers.get_all_timers_string(["step", "only-on-rank-1"])
    return results


def test_min_and_max_across_ranks():
    rank0, rank1 = run_distributed(2, _report_from_two_ranks)
    assert rank0 == rank1
    assert rank0["minmax"].splitlines()[1:] == [
        "    " + "step ".ljust(48, ".") + ": (100.00, 200.00)",
        "    " + "only-on-rank-1 ".ljust(48, ".") + ": (300.00, 300.00)",
    ]
    assert rank0["all"].splitlines() == [
        "times across ranks (ms):",
        "  step:",
        "     rank  0: 100.00",
        "     rank  1: 200.00",
        "  only-on-rank-1:",
        "     rank  1: 300.00",
    ]
