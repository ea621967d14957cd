"""How a rank ends a job that fails: say why once, exit at once, never hang, never outlive the launcher.

Three rules, each for a failure mode a multi-rank job otherwise has:

- **Exit at once.** A rank that raises leaves with ``os._exit`` after flushing its output, so nothing at interpreter
  shutdown can hold it: Python's ``multiprocessing`` joins the DataLoader workers at exit, and those workers ignore
  SIGTERM (so the rank's ``--exit-signal-handler`` can save when a scheduler signals the whole job), which turned
  every exception into a hang.
- **Say why once.** Every rank of a job usually hits the same error (a bad flag, a missing file), and the ranks
  still waiting for a failed peer then fail on the broken connection. The first rank on this machine to report an
  error prints it; the others stay quiet about it, and ranks that only lost a peer print nothing. An input error (a
  ``ValueError`` naming a flag, a file or a checkpoint) is one short block that starts with the message; any other
  exception is a crash and keeps its traceback, once per distinct error. Set ``MEGATRON_LITE_VERBOSE_ERRORS=1`` to
  have every rank print its own full traceback.
- **Never outlive the launcher.** torchrun starts each rank in a session of its own, so killing torchrun (a
  cancelled SLURM step, a closed terminal) does not reach the ranks; :func:`exit_with_launcher` makes a rank die
  with the process that started it.

These rules apply to the ranks of a torchrun job. Elsewhere (a test or notebook calling ``pretrain``) exceptions
propagate as usual, and DataLoader workers keep SIGTERM, so nothing hangs. A command-line tool or entry point run
as a plain process (``python tools/checkpoint/convert.py``, ``python pretrain_gpt.py``) goes through
:func:`run_tool`: any error ends it with one ``error:`` line and a hint, exit code 1; the traceback only with
``MEGATRON_LITE_VERBOSE_ERRORS=1``.

Reports are de-duplicated through marker files in a per-job directory under the temporary directory, named after
the launcher's process and rendezvous port, so ranks need no collective (which could hang) to agree on who speaks.
On a multi-node job each node reports once.
"""

import ctypes
import errno
import hashlib
import multiprocessing
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from megatron.core.dist_checkpointing.core import CheckpointingException

VERBOSE_ERRORS_ENV = "MEGATRON_LITE_VERBOSE_ERRORS"

# Errors raised on purpose for bad input: their message is the whole story.
INPUT_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    CheckpointingException,
)

# What a collective raises on a rank whose peer went away (gloo and NCCL wording).
_LOST_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket Timeout|remote process exited|"
    r"ProcessGroup.*(?:aborted|terminated)|NCCL communicator was aborted",
    re.IGNORECASE,
)
# An OS error about an address the user chose (``--host``/``--port``) is bad input, like a missing file.
_ADDRESS_ERRNOS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PARENT_POLL_S = 0.5


def is_lost_peer_error(exc: BaseException) -> bool:
    """True when ``exc`` only says that another rank of the job is gone (that rank reports the cause)."""
    return isinstance(exc, (RuntimeError, ConnectionError, OSError)) and bool(_LOST_PEER.search(str(exc)))


def is_input_error(exc: BaseException) -> bool:
    """True for errors whose message is the whole story: bad flags, files, checkpoints, and OS errors that name the
    file (``filename``) or the address they are about."""
    if isinstance(exc, INPUT_ERRORS):
        return True
    return isinstance(exc, OSError) and (exc.filename is not None or exc.errno in _ADDRESS_ERRNOS)


def _verbose() -> bool:
    return os.environ.get(VERBOSE_ERRORS_ENV, "") not in ("", "0")


def _rank() -> str:
    return os.environ.get("RANK", "0")


def format_input_error(exc: BaseException) -> str:
    """The short block an input error prints: the message first, then where it came from."""
    world_size = os.environ.get("WORLD_SIZE")
    where = f"rank {_rank()} of {world_size}" if world_size else "this process"
    return (
        f"error: {exc}\n"
        f"  ({type(exc).__name__} on {where}; set {VERBOSE_ERRORS_ENV}=1 for the traceback of every rank)\n"
    )


def format_crash(exc: BaseException) -> str:
    """A crash keeps its traceback, prefixed with the rank that hit it."""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return f"rank {_rank()} crashed:\n" + "".join(lines)


def _job_report_dir() -> str:
    """One directory per job on this machine: ranks of one torchrun share its pid and rendezvous port."""
    job = "|".join(
        [
            socket.gethostname(),
            str(os.getppid()),
            os.environ.get("MASTER_ADDR", ""),
            os.environ.get("MASTER_PORT", ""),
            os.environ.get("TORCHELASTIC_RUN_ID", ""),
        ]
    )
    digest = hashlib.sha1(job.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"megatron-lite-errors-{digest}")


def _first_to_report(key: str) -> bool:
    """Claim ``key`` for this job atomically (O_EXCL); only the first rank to claim it reports it."""
    directory = _job_report_dir()
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, key), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True  # no shared temporary directory: better twice than never
    os.write(fd, _rank().encode())
    os.close(fd)
    return True


def _fingerprint(exc: BaseException) -> str:
    """Errors that differ only in the rank they name are the same error."""
    message = re.sub(r"\brank \d+", "rank N", f"{type(exc).__name__}: {exc}")
    return hashlib.sha1(message.encode()).hexdigest()[:16]


def report_error(exc: BaseException, stream=None) -> bool:
    """Print ``exc`` the way this module's rules say; returns whether this rank printed anything."""
    stream = stream if stream is not None else sys.stderr
    if _verbose():
        stream.write(format_crash(exc))
    elif is_lost_peer_error(exc):
        return False
    elif not _first_to_report(_fingerprint(exc)):
        return False
    elif is_input_error(exc):
        stream.write(format_input_error(exc))
    else:
        stream.write(format_crash(exc))
    stream.flush()
    return True


def exit_now(code: int) -> None:
    """Leave without running interpreter shutdown (which joins DataLoader workers), after killing this rank's
    worker processes and flushing its output."""
    for child in multiprocessing.active_children():
        child.kill()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


@contextmanager
def exit_on_error(before_exit: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Run the body (or, as a decorator, the function); if it raises in a rank of a torchrun job, report the error
    once for the job, call ``before_exit`` (e.g. to flush log writers) and end the rank with exit code 1 (130 for
    Ctrl-C). Anywhere else (a test, a notebook, a plain ``python`` run) the exception propagates as usual, and
    ``SystemExit`` always does: it is a deliberate exit (a finished job, argparse's usage error)."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, SystemExit) or not launched_by_torchrun():
            raise
        if not isinstance(exc, KeyboardInterrupt):
            report_error(exc)
        if before_exit is not None:
            try:
                before_exit()
            except Exception:  # noqa: BLE001 - the error being reported matters more than a failed flush
                pass
        exit_now(130 if isinstance(exc, KeyboardInterrupt) else 1)


# ---- command-line tools run as one process ---------------------------------------------------------------------


def format_tool_error(exc: BaseException) -> str:
    """What a tool prints for ``exc``: one ``error:`` line (the exception's type too when it is not an input error,
    which says a bug rather than bad input), then the hint that gives the traceback."""
    message = str(exc).strip() or type(exc).__name__
    if not is_input_error(exc):
        message = f"{type(exc).__name__}: {message}"
    return f"error: {message}\n  (set {VERBOSE_ERRORS_ENV}=1 for the traceback)\n"


def run_tool(main: Callable[..., Optional[int]], *args, stream=None) -> int:
    """Run a tool's ``main(*args)`` and return its exit code (``None`` counts as 0). An exception is reported as
    :func:`format_tool_error` says and gives 1 (Ctrl-C: 130); with ``MEGATRON_LITE_VERBOSE_ERRORS=1`` the full
    traceback is printed instead. ``SystemExit`` passes through (argparse's usage errors already print one line).
    Under torchrun the job's rules apply (:func:`exit_on_error`): the rank reports once for the job and exits."""
    stream = stream if stream is not None else sys.stderr
    if launched_by_torchrun():
        with exit_on_error():
            return main(*args) or 0
    try:
        return main(*args) or 0
    except KeyboardInterrupt:
        stream.write("interrupted\n")
        return 130
    except Exception as exc:  # noqa: BLE001 - every error of a tool ends in one line; the traceback is opt-in
        stream.write(format_crash(exc) if _verbose() else format_tool_error(exc))
        stream.flush()
        return 1


def tool_main(main: Callable[[], Optional[int]]) -> None:
    """The ``if __name__ == "__main__":`` of a tool: :func:`run_tool` then exit with its code."""
    sys.exit(run_tool(main))


# ---- dying with the launcher -------------------------------------------------------------------------------------


def _set_parent_death_signal(sig: int) -> bool:
    """Linux: have the kernel send ``sig`` to this process when its parent exits. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit_when_parent_changes(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """End this process as soon as its parent (``parent_pid``, by default the current one) is gone: the kernel's
    parent-death signal where there is one, otherwise a thread that watches the parent. Nothing is written after."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    if not _set_parent_death_signal(signal.SIGKILL):
        threading.Thread(
            target=_exit_when_parent_changes, args=(parent_pid,), daemon=True, name="megatron-parent-watch"
        ).start()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def exit_with_launcher() -> None:
    """Under torchrun, tie this rank's life to torchrun's. A rank started any other way (``python pretrain_gpt.py``
    under nohup, srun without torchrun) keeps its usual life: its parent may legitimately go first."""
    if launched_by_torchrun():
        die_with_parent()
