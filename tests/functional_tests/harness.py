"""Run the real entry point (`pretrain_gpt.py` under torchrun) as a subprocess and read its Megatron log line.

Every functional test goes through :func:`run_pretrain` (or :class:`PretrainProcess` when it must interact with a
running job): `python -m torch.distributed.run --nproc_per_node N pretrain_gpt.py ...` on CPU ranks with gloo, one
thread per rank (so fp32 results are reproducible), a free rendezvous port per run, and a timeout that turns a hang
into a failure showing the command and the end of its output. :func:`parse_training_log` is the one parser of
Megatron-LM's training and validation log lines.
"""

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set

from megatron.training import builtin_data

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINT = REPO_ROOT / "pretrain_gpt.py"
DEFAULT_TIMEOUT_S = 180
_OUTPUT_TAIL_CHARS = 4000

# Fusions off: the golden values and equivalence curves were recorded unfused (exact GeLU, plain ops); the fusions
# have their own tests (tests/unit_tests/fusions).
CPU_FLAGS = [
    "--distributed-backend",
    "gloo",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
]


def builtin_data_flags(data_cache_path: Optional[Path] = None) -> List[str]:
    """The shipped Shakespeare corpus and its BPE tokenizer (98% train, 2% validation)."""
    flags = [
        "--data-path",
        builtin_data.data_prefix(),
        "--split",
        "98,2,0",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        builtin_data.vocab_file(),
        "--merge-file",
        builtin_data.merge_file(),
    ]
    if data_cache_path is not None:
        flags += ["--data-cache-path", str(data_cache_path)]
    return flags


def free_port() -> int:
    """A TCP port nobody listens on right now (for torchrun's --master_port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(args: Sequence[str], nproc: int, entry_point: Path = ENTRY_POINT) -> List[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(entry_point),
        *map(str, args),
    ]


def _subprocess_env(threads_per_rank: int) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads_per_rank), PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    return env


@dataclass
class RunResult:
    command: List[str]
    returncode: int
    output: str

    @property
    def records(self) -> List[Dict[str, float]]:
        return parse_training_log(self.output)

    def curve(self, key: str = "lm loss") -> Dict[int, float]:
        return loss_curve(self.records, key)

    def describe(self) -> str:
        return (
            f"command: {' '.join(self.command)}\nexit code: {self.returncode}\n"
            f"last output:\n{self.output[-_OUTPUT_TAIL_CHARS:]}"
        )


def run_pretrain(
    args: Sequence[str],
    nproc: int = 1,
    timeout: float = DEFAULT_TIMEOUT_S,
    expect_success: bool = True,
    threads_per_rank: int = 1,
    entry_point: Path = ENTRY_POINT,
    env: Optional[Dict[str, str]] = None,
) -> RunResult:
    """Run pretrain_gpt.py on `nproc` CPU ranks and return its combined output.

    With `expect_success` a non-zero exit fails the test with the command and the end of the output; a run that
    outlives `timeout` is killed (with its whole process group) and fails the same way, as a hang. Tests keep one
    thread per rank (reproducible fp32 sums); benchmarks give each rank its share of the cores. `entry_point`
    replaces pretrain_gpt.py (tests that inject failures wrap it); `env` adds environment variables.
    """
    process = PretrainProcess(args, nproc, threads_per_rank, entry_point, env)
    result = process.wait(timeout)
    if expect_success and result.returncode != 0:
        raise AssertionError(f"pretrain_gpt.py on {nproc} rank(s) failed\n{result.describe()}")
    return result


class PretrainProcess:
    """A running torchrun job in its own process group, its output read line by line as it arrives."""

    def __init__(
        self,
        args: Sequence[str],
        nproc: int = 1,
        threads_per_rank: int = 1,
        entry_point: Path = ENTRY_POINT,
        env: Optional[Dict[str, str]] = None,
    ):
        self.nproc = nproc
        self.command = torchrun_command(args, nproc, entry_point)
        self._lines: List[str] = []
        self._queue: "queue.Queue[Optional[str]]" = queue.Queue()
        self._popen = subprocess.Popen(
            self.command,
            cwd=REPO_ROOT,
            env={**_subprocess_env(threads_per_rank), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: one signal reaches torchrun and every rank
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._started = time.monotonic()

    def _read(self) -> None:
        for line in self._popen.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def _next_line(self, deadline: float) -> Optional[str]:
        """The next output line (kept in the transcript); None at the end of the output; TimeoutError at `deadline`."""
        try:
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None
        if line is not None:
            self._lines.append(line)
        return line

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def wait_for_line(self, predicate: Callable[[str], bool], timeout: float = DEFAULT_TIMEOUT_S) -> str:
        """Block until an output line satisfies `predicate`; fail (killing the job) if the job ends or time runs out."""
        deadline = time.monotonic() + timeout
        try:
            while (line := self._next_line(deadline)) is not None:
                if predicate(line):
                    return line
            ended = "the job ended first"
        except TimeoutError:
            ended = f"it did not appear within {timeout:.0f} s"
        self.kill()
        raise AssertionError(f"waiting for a log line: {ended}\n{self._result().describe()}")

    @property
    def launcher_pid(self) -> int:
        """torchrun's process id (the ranks are its children)."""
        return self._popen.pid

    def send_signal_to_group(self, sig: int = signal.SIGTERM) -> None:
        """Deliver `sig` to torchrun and every rank at once, as a cluster scheduler does."""
        os.killpg(self._popen.pid, sig)

    def kill(self) -> None:
        try:
            os.killpg(self._popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._popen.wait()

    def wait(self, timeout: float = DEFAULT_TIMEOUT_S) -> RunResult:
        """Wait for the job to end and collect its output; kill it and fail as a hang `timeout` s after its start."""
        deadline = self._started + timeout
        try:
            while self._next_line(deadline) is not None:
                pass
        except TimeoutError:
            self.kill()
            raise AssertionError(
                f"pretrain_gpt.py on {self.nproc} rank(s) did not finish within {timeout:.0f} s (a hang?); "
                f"killed\n{self._result().describe()}"
            ) from None
        self._popen.wait()
        return self._result()

    def _result(self) -> RunResult:
        returncode = self._popen.poll()
        return RunResult(self.command, -1 if returncode is None else returncode, self.output)


# ---- the process tree of a job (Linux /proc) ---------------------------------------------------------------------


def _children_by_parent() -> Dict[int, List[int]]:
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name (field 2) is in parentheses and may hold spaces; the parent pid follows the state.
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    return children


def descendants(pid: int) -> Set[int]:
    """Every process below `pid` (for a torchrun: its ranks and their DataLoader workers)."""
    tree = _children_by_parent()
    found: Set[int] = set()
    stack = [pid]
    while stack:
        for child in tree.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive_processes(pids: Set[int]) -> Set[int]:
    """The processes of `pids` still running (a zombie has exited: only its parent's reaping is left)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def kill_processes(pids: Set[int]) -> None:
    for pid in alive_processes(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- Megatron-LM's log lines -----------------------------------------------------------------------------------

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_VALIDATION = re.compile(r"validation loss at (.*?) \|")


def _fields(text: str) -> Dict[str, float]:
    """`key: value |` pairs of a log line, as floats (the numeric ones)."""
    fields = {}
    for field in text.split("|"):
        key, separator, value = field.rpartition(":")
        if not separator:
            continue
        try:
            fields[key.strip()] = float(value)
        except ValueError:
            continue
    return fields


def parse_training_log(text: str) -> List[Dict[str, float]]:
    """One dict per training log line: `iteration`, `train_iters` and every `key: value` field (`lm loss`,
    `learning rate`, `grad norm`, `consumed samples`, `number of skipped iterations`, ...), in order."""
    records = []
    for line in text.splitlines():
        match = _ITERATION.search(line)
        if match is None:
            continue
        record = {"iteration": int(match.group(1)), "train_iters": int(match.group(2))}
        record.update(_fields(line[match.end() :]))
        records.append(record)
    return records


def parse_validation_log(text: str) -> Dict[str, Dict[str, float]]:
    """`{"iteration 10": {"lm loss value": ..., "lm loss PPL": ...}}` from the validation lines."""
    results = {}
    for line in text.splitlines():
        match = _VALIDATION.search(line)
        if match is not None:
            results[match.group(1)] = _fields(line[match.end() :])
    return results


def loss_curve(records: List[Dict[str, float]], key: str = "lm loss") -> Dict[int, float]:
    """`{iteration: value}` of one field over the training log."""
    return {int(record["iteration"]): record[key] for record in records if key in record}


def assert_curves_close(actual: Dict[int, float], expected: Dict[int, float], rel_tol: float, what: str) -> None:
    """Every iteration of `expected` is in `actual`, within `rel_tol`; a mismatch prints both curves side by side."""
    missing = sorted(set(expected) - set(actual))
    bad = [i for i in sorted(expected) if i in actual and abs(actual[i] - expected[i]) > rel_tol * abs(expected[i])]
    if missing or bad:
        rows = "\n".join(
            f"  {i:4d}  {expected[i]:.6e}  {actual.get(i, float('nan')):.6e}{'  <-' if i in bad else ''}"
            for i in sorted(expected)
        )
        raise AssertionError(
            f"{what}: iterations {bad} differ by more than rel {rel_tol:g}; missing iterations {missing}\n"
            f"  iter  expected      actual\n{rows}"
        )
