"""The reporting rules of megatron.training.error_handling, in one process (the multi-rank behaviour is tested end
to end in tests/functional_tests/test_failures.py)."""

import io
import os
import subprocess
import sys
import textwrap
import time

import pytest

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.training import error_handling


@pytest.fixture
def job(monkeypatch, tmp_path):
    """This process as rank 1 of a 4-rank torchrun job whose reports go under tmp_path."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", str(os.getpid()))
    monkeypatch.setattr(error_handling.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv(error_handling.VERBOSE_ERRORS_ENV, raising=False)


def _report(exc) -> str:
    stream = io.StringIO()
    error_handling.report_error(exc, stream)
    return stream.getvalue()


def test_an_input_error_is_a_short_block_starting_with_the_message(job):
    text = _report(ValueError("--lr must be positive, got -1"))
    assert text.splitlines()[0] == "error: --lr must be positive, got -1"
    assert "ValueError on rank 1 of 4" in text and "Traceback" not in text
    assert len(text.splitlines()) == 2
    assert _report(CheckpointingException("checkpoint x is incomplete")).startswith("error: checkpoint x")


def test_a_crash_keeps_its_traceback(job):
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        text = _report(exc)
    assert text.startswith("rank 1 crashed:\nTraceback") and "RuntimeError: boom" in text


def test_the_same_error_is_reported_once_per_job_even_when_it_names_another_rank(job):
    assert _report(RuntimeError("rank 1: found NaN in gradients"))
    assert _report(RuntimeError("rank 3: found NaN in gradients")) == ""
    assert _report(RuntimeError("something else"))


def test_a_rank_that_only_lost_its_peer_stays_quiet(job):
    assert _report(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")) == ""
    assert not error_handling.is_lost_peer_error(ValueError("--data-path: no dataset at x"))


def test_verbose_errors_make_every_rank_print_its_traceback(job, monkeypatch):
    monkeypatch.setenv(error_handling.VERBOSE_ERRORS_ENV, "1")
    assert "crashed" in _report(ValueError("same"))
    assert "crashed" in _report(ValueError("same"))


def test_outside_torchrun_an_exception_propagates(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ValueError, match="plain"):
        with error_handling.exit_on_error():
            raise ValueError("plain")


def test_under_torchrun_a_rank_reports_and_exits_without_waiting_for_its_children(tmp_path):
    """A child that ignores SIGTERM (like a DataLoader worker) would hold a normal interpreter exit forever."""
    script = textwrap.dedent(
        """
        import multiprocessing, signal, time
        from megatron.training.error_handling import exit_on_error

        def stubborn():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(600)

        if __name__ == "__main__":
            child = multiprocessing.Process(target=stubborn, daemon=True)
            child.start()
            with exit_on_error(before_exit=lambda: print("flushed", flush=True)):
                raise ValueError("--micro-batch-size must be positive")
        """
    )
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "RANK": "0", "WORLD_SIZE": "1", "TMPDIR": str(tmp_path)}
    ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1, ran.stderr
    assert ran.stderr.startswith("error: --micro-batch-size must be positive"), ran.stderr
    assert "flushed" in ran.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks and reads /proc")
def test_die_with_parent_ends_the_process_when_its_parent_is_gone(tmp_path):
    """A grandchild armed with die_with_parent() outlives its parent by no more than a moment."""
    marker = tmp_path / "grandchild_pid"
    script = textwrap.dedent(
        f"""
        import os, time
        from megatron.training.error_handling import die_with_parent
        if os.fork() == 0:
            die_with_parent()
            open({str(marker)!r}, "w").write(str(os.getpid()))
            time.sleep(600)
        else:
            while not os.path.exists({str(marker)!r}):
                time.sleep(0.05)
            os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", script], timeout=60, check=True)
    grandchild = int(marker.read_text())
    for _ in range(100):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{grandchild}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.05)
    os.kill(grandchild, 9)
    raise AssertionError("the grandchild outlived its parent by 5 s")


def test_an_os_error_naming_its_file_or_address_is_input_not_a_crash():
    import errno

    assert error_handling.is_input_error(OSError(errno.ENOSPC, "No space left on device", "/ckpt/x.distcp"))
    in_use = OSError("--port 5000: cannot listen there")
    in_use.errno = errno.EADDRINUSE
    assert error_handling.is_input_error(in_use)
    assert not error_handling.is_input_error(OSError("something without a file"))
    assert not error_handling.is_input_error(RuntimeError("boom"))


def test_a_tool_reports_any_error_in_one_line_and_exits_1(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(error_handling.VERBOSE_ERRORS_ENV, raising=False)

    def fails(exc):
        raise exc

    stream = io.StringIO()
    assert error_handling.run_tool(fails, ValueError("--input x: no such file"), stream=stream) == 1
    hint = f"  (set {error_handling.VERBOSE_ERRORS_ENV}=1 for the traceback)"
    assert stream.getvalue().splitlines() == ["error: --input x: no such file", hint]
    stream = io.StringIO()
    assert error_handling.run_tool(fails, KeyError("weight"), stream=stream) == 1
    assert stream.getvalue().splitlines()[0] == "error: KeyError: 'weight'"  # a bug says its type
    assert error_handling.run_tool(lambda: None) == 0 and error_handling.run_tool(lambda: 3) == 3
    with pytest.raises(SystemExit):
        error_handling.run_tool(fails, SystemExit(2))


def test_a_verbose_tool_prints_the_traceback(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv(error_handling.VERBOSE_ERRORS_ENV, "1")

    def fails():
        raise ValueError("--input x: no such file")

    stream = io.StringIO()
    assert error_handling.run_tool(fails, stream=stream) == 1
    assert "Traceback (most recent call last)" in stream.getvalue()
