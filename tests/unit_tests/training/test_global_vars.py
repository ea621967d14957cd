"""global_vars: set/get/unset of the run's globals, the tokenizer and padded vocabulary, the micro-batch calculator,
and the TensorBoard / W&B writers (with stand-in modules: neither package is a test dependency)."""

import sys
import types

import pytest

from megatron.training import global_vars
from megatron.training.global_vars import (
    get_args,
    get_num_microbatches,
    get_tensorboard_writer,
    get_timers,
    get_tokenizer,
    get_wandb_writer,
    set_global_variables,
    unset_global_variables,
)
from megatron.training.timers import DummyTimer, Timer, Timers
from tests.unit_tests.training.test_arguments import validated


@pytest.fixture(autouse=True)
def clean_globals():
    unset_global_variables()
    yield
    unset_global_variables()


def on_rank(args, rank, world_size):
    args.rank, args.world_size = rank, world_size
    return args


def test_getters_before_initialization_say_what_to_call():
    with pytest.raises(RuntimeError, match=r"args is not initialized; call set_global_variables\(args\)"):
        get_args()
    with pytest.raises(RuntimeError, match="tokenizer is not initialized"):
        get_tokenizer()
    with pytest.raises(RuntimeError, match="timers is not initialized"):
        get_timers()
    assert (get_tensorboard_writer(), get_wandb_writer()) == (None, None)


def test_set_global_variables_sets_everything():
    args = validated("--global-batch-size", 8, "--timing-log-level", 1, "--timing-log-option", "max")
    set_global_variables(args)
    assert get_args() is args
    assert get_tokenizer().vocab_size == 101  # NullTokenizer adds its end-of-document token
    assert args.padded_vocab_size == 128  # padded to a multiple of --make-vocab-size-divisible-by x TP
    assert get_num_microbatches() == 4  # 8 / (micro-batch 2 x data-parallel 1)
    timers = get_timers()
    assert isinstance(timers, Timers)
    assert isinstance(timers("step", log_level=1), Timer) and isinstance(timers("inner", log_level=2), DummyTimer)
    assert (get_tensorboard_writer(), get_wandb_writer()) == (None, None)


def test_set_twice_needs_an_unset_in_between():
    args = validated()
    set_global_variables(args)
    with pytest.raises(RuntimeError, match=r"already set; call unset_global_variables\(\) first"):
        set_global_variables(args)
    unset_global_variables()
    with pytest.raises(RuntimeError, match="args is not initialized"):
        get_args()
    with pytest.raises(RuntimeError, match="num microbatches calculator is not initialized"):
        get_num_microbatches()
    set_global_variables(args, build_tokenizer=False)
    with pytest.raises(RuntimeError, match="tokenizer is not initialized"):
        get_tokenizer()


def test_none_is_rejected():
    with pytest.raises(ValueError, match="set_global_variables needs the validated arguments, got None"):
        set_global_variables(None)


def fake_module(monkeypatch, name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


class FakeSummaryWriter:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def test_tensorboard_writer_on_the_last_rank_only(monkeypatch, tmp_path):
    fake_module(monkeypatch, "torch.utils.tensorboard", SummaryWriter=FakeSummaryWriter)
    args = validated("--tensorboard-dir", tmp_path, "--tensorboard-queue-size", 7, world_size=2)
    set_global_variables(on_rank(args, 0, 2))
    assert get_tensorboard_writer() is None
    unset_global_variables()
    set_global_variables(on_rank(args, 1, 2))
    assert get_tensorboard_writer().kwargs == {"log_dir": str(tmp_path), "max_queue": 7}


def test_wandb_writer_on_the_last_rank(monkeypatch, tmp_path):
    calls = []
    wandb = fake_module(monkeypatch, "wandb", init=lambda **kwargs: calls.append(kwargs))
    args = validated(
        "--wandb-project",
        "proj",
        "--wandb-exp-name",
        "run1",
        "--wandb-entity",
        "team",
        "--save",
        tmp_path,
        "--save-interval",
        5,
    )
    set_global_variables(args)
    assert get_wandb_writer() is wandb
    (kwargs,) = calls
    assert (kwargs["project"], kwargs["name"], kwargs["entity"]) == ("proj", "run1", "team")
    assert kwargs["dir"] == str(tmp_path / "wandb") and (tmp_path / "wandb").is_dir()
    assert kwargs["config"]["wandb_project"] == "proj"


@pytest.mark.parametrize(
    "module, flags, message",
    [
        ("torch.utils.tensorboard", ("--tensorboard-dir", "/tmp/tb"), "the tensorboard package is not installed"),
        (
            "wandb",
            ("--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", "/tmp/w"),
            "the wandb package is not installed",
        ),
    ],
)
def test_missing_logging_package_warns_and_logs_nothing(monkeypatch, module, flags, message):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    with pytest.warns(UserWarning, match=message):
        set_global_variables(validated(*flags))
    assert (get_tensorboard_writer(), get_wandb_writer()) == (None, None)


def test_microbatch_getters_are_re_exported():
    assert global_vars.get_num_microbatches is get_num_microbatches
    assert {"get_current_global_batch_size", "update_num_microbatches"} <= set(global_vars.__all__)


def test_exit_signal_handler_is_installed_from_set_global_variables_and_destroyed():
    import os
    import signal

    previous = signal.getsignal(signal.SIGUSR1)
    args = validated("--exit-signal-handler")
    args.exit_signal = signal.SIGUSR1
    set_global_variables(args)
    handler = global_vars.get_signal_handler()
    os.kill(os.getpid(), signal.SIGUSR1)  # recorded, not fatal
    assert handler.signals_received() == [True]
    global_vars.destroy_global_vars()
    assert global_vars.get_signal_handler() is None
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_no_signal_handler_without_the_flag_and_vendor_services_are_absent():
    set_global_variables(validated())
    assert global_vars.get_signal_handler() is None
    assert global_vars.get_one_logger() is None and global_vars.get_energy_monitor() is None
    assert global_vars.get_adlr_autoresume() is None


def test_adlr_autoresume_without_nvidias_library_warns(monkeypatch):
    monkeypatch.setitem(sys.modules, "userlib", None)  # not importable
    args = validated()
    args.adlr_autoresume = True
    with pytest.warns(UserWarning, match="userlib.auto_resume .* is not installed; the flag has no effect"):
        set_global_variables(args)
    assert global_vars.get_adlr_autoresume() is None


def test_adlr_autoresume_uses_the_library_when_present(monkeypatch):
    auto_resume = types.ModuleType("userlib.auto_resume")
    auto_resume.AutoResume = type("AutoResume", (), {})
    monkeypatch.setitem(sys.modules, "userlib", types.ModuleType("userlib"))
    monkeypatch.setitem(sys.modules, "userlib.auto_resume", auto_resume)
    args = validated()
    args.adlr_autoresume = True
    set_global_variables(args)
    assert global_vars.get_adlr_autoresume() is auto_resume.AutoResume


def test_args_already_set_by_parse_and_validate_args_may_be_completed():
    args = validated()
    global_vars.set_args(args)
    set_global_variables(args)  # the same arguments: the other globals are filled in
    assert get_timers() is not None
    other = validated()
    unset_global_variables()
    global_vars.set_args(args)
    with pytest.raises(RuntimeError, match="already set"):
        set_global_variables(other)


def test_rebuild_tokenizer_replaces_the_runs_tokenizer():
    args = validated()
    set_global_variables(args)
    first = get_tokenizer()
    rebuilt = global_vars.rebuild_tokenizer(args)
    assert get_tokenizer() is rebuilt and rebuilt is not first and rebuilt.vocab_size == first.vocab_size


def test_destroy_global_vars_closes_the_tensorboard_writer(monkeypatch):
    closed = []
    writer = types.SimpleNamespace(close=lambda: closed.append(True))
    set_global_variables(validated())
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", writer)
    global_vars.destroy_global_vars()
    assert closed == [True]
    with pytest.raises(RuntimeError, match="args is not initialized"):
        get_args()
