"""Run one of Megatron-LM's own launch scripts (``examples/**/*.sh``), unchanged, on this CPU machine.

    python tools/run_megatron_example.py path/to/train_gpt3_175b_distributed.sh -- ckpt tb vocab.json merges.txt data

The script itself is executed by bash, so its variables, arrays, ``if`` blocks and ``case`` statements evaluate
exactly as on a cluster; only the launchers are stand-ins (``torchrun``, ``python -m torch.distributed.run``,
``python .../pretrain_*.py``, ``sbatch``, ``srun``, ``uv run``): they record the command line they were given
instead of starting anything. The recorded arguments then go through the few overrides below, everything else
is passed to this repository's entry point (``pretrain_gpt.py``, ``pretrain_hybrid.py``, ...) as written, and the
job runs for a few iterations on CPU ranks with gloo. It passes when the entry point reaches the training loop (an
``iteration 1/`` log line) and exits 0.

The overrides (each one that applies is listed in the report):

- model sizes: the flags in ``TINY_SIZES`` get tiny values (only where the script sets them), and a list-valued
  ``--moe-layer-freq`` keeps its first ``--num-layers`` entries;
- parallel sizes: ``--tensor/pipeline/context/expert-model-parallel-size`` above 1 become 2 (at most two of
  TP/PP/CP, in that order), and the world size is the smallest that holds the layout with the experts;
- batch and run length: micro batch 1, a global batch of two micro batches per data-parallel rank, ``--train-iters``
  (or ``--train-samples``) for ``--iterations`` steps, ``--log-interval 1``, ``--eval-iters 1``; a batch-size
  ramp-up is dropped;
- data: ``--data-path`` (and the per-split paths) become ``--mock-data``; a tokenizer whose files are not on this
  machine, or none at all, becomes ``NullTokenizer`` (its vocabulary size is in ``TINY_SIZES``);
- ``GPU_ONLY_FLAGS``: the settings this project refuses because they need NVIDIA-only kernels (the flex token
  dispatcher on DeepEP / HybridEP); they are dropped.

Every other GPU setting (FP8/FP4 recipes, fusions, ``--use-flash-attn``, ``--transformer-impl
transformer_engine`` without Transformer Engine, ``--distributed-backend nccl``, NCCL tuning, ``--profile``) is
passed unchanged: the entry point accepts it and turns it off with one warning, as it would for any user.
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ("pretrain_gpt.py", "pretrain_hybrid.py", "pretrain_mamba.py")
FIRST_ITERATION = re.compile(r"\biteration\s+1/\s*\d+\s*\|")

# Tiny values for the flags that set a model's size; a flag the script does not set stays unset.
TINY_SIZES = {
    "--num-layers": "4",
    "--hidden-size": "256",
    "--ffn-hidden-size": "512",
    "--num-attention-heads": "4",
    "--num-query-groups": "2",
    "--kv-channels": "64",
    "--seq-length": "64",
    "--max-position-embeddings": "64",
    "--decoder-seq-length": "64",
    "--vocab-size": "1024",
    "--num-experts": "4",
    "--moe-ffn-hidden-size": "256",
    "--moe-shared-expert-intermediate-size": "256",
    "--q-lora-rank": "64",
    "--kv-lora-rank": "32",
    "--qk-head-dim": "32",
    "--qk-pos-emb-head-dim": "16",
    "--v-head-dim": "32",
}
# What this project refuses because it needs NVIDIA-only kernels, as flag -> refused values (None: any value): the
# flex token dispatcher runs on DeepEP / HybridEP. Dropped, so the default dispatcher runs. (Every other GPU knob,
# FP8 recipes and fusions included, is accepted by the entry point and turned off with a warning.)
GPU_ONLY_FLAGS = {
    "--moe-token-dispatcher-type": ("flex",),
    "--moe-flex-dispatcher-backend": None,
}
PARALLEL_SIZES = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
)
DATA_PATHS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path")
TOKENIZER_FILES = ("--tokenizer-model", "--vocab-file", "--merge-file")
DROPPED_SCHEDULES = ("--rampup-batch-size", "--step-batch-size-schedule")

# Stand-ins put first on PATH while the script runs. `record` writes the command line (NUL-separated) and the
# environment the script built, then exits 0 as if the job had finished.
_RECORD = 'printf "%s\\0" "$@" > "$CAPTURED_COMMAND"; env -0 > "$CAPTURED_ENV"; exit 0'
_STAND_INS = {
    "torchrun": f'set -- torchrun "$@"; {_RECORD}',
    # `python` records a launch of an entry point (directly or through torch.distributed.run), else runs python.
    "python": (
        'for arg in "$@"; do case "$arg" in torch.distributed.run|*pretrain_*.py) '
        f'set -- python "$@"; {_RECORD};; esac; done; exec "$REAL_PYTHON" "$@"'
    ),
    "sbatch": 'while [[ "${1:-}" == -* ]]; do shift; done; if [[ $# -gt 0 ]]; then exec bash "$@"; fi; exec bash -s',
    "srun": 'while [[ "${1:-}" == -* ]]; do shift; done; exec "$@"',
    "uv": '[[ "${1:-}" == run ]] && shift; exec "$@"',
}
_STAND_INS["python3"] = _STAND_INS["python"]
# Variables of the script's environment that belong to the capture, not to the job.
_NOT_PASSED_ON = {"PATH", "PWD", "OLDPWD", "SHLVL", "_", "CAPTURED_COMMAND", "CAPTURED_ENV", "REAL_PYTHON"}


@dataclass
class Launch:
    """What the launch script would have started: the launcher's options, the entry point and its arguments."""

    launcher: List[str]
    entry_point: str
    arguments: List[str]
    environment: Dict[str, str] = field(default_factory=dict)


def capture_launch(script: Path, script_args: Sequence[str], workdir: Path, env: Dict[str, str]) -> Launch:
    """Run ``script`` with bash in ``workdir`` with the stand-in launchers; return the launch it asked for."""
    bin_dir = workdir / ".stand-ins"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in _STAND_INS.items():
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    for entry in ENTRY_POINTS:  # scripts check that they run from a Megatron-LM checkout
        (workdir / entry).touch()
    command_file, env_file = bin_dir / "command", bin_dir / "environment"
    command_file.unlink(missing_ok=True)
    script_env = {
        **env,
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "CAPTURED_COMMAND": str(command_file),
        "CAPTURED_ENV": str(env_file),
        "REAL_PYTHON": sys.executable,
    }
    ran = subprocess.run(
        ["bash", str(script), *script_args], cwd=workdir, env=script_env, capture_output=True, text=True, timeout=120
    )
    if not command_file.exists():
        raise RuntimeError(
            f"{script} exited with status {ran.returncode} without launching an entry point "
            f"(pass the script's own arguments after --):\n{ran.stdout[-2000:]}{ran.stderr[-2000:]}"
        )
    return _parse_launch(command_file.read_text().split("\0")[:-1], env_file, env)


def _parse_launch(command: List[str], env_file: Path, env: Dict[str, str]) -> Launch:
    entry = next(i for i, arg in enumerate(command) if Path(arg).name.startswith("pretrain_"))
    launcher = command[1:entry]
    if command[0] == "python":  # `python -m torch.distributed.run <options>` or `python pretrain_x.py` (one rank)
        launcher = launcher[2:] if launcher[:2] == ["-m", "torch.distributed.run"] else []
    script_env = dict(item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
    changed = {k: v for k, v in script_env.items() if env.get(k) != v and k not in _NOT_PASSED_ON}
    return Launch(launcher, Path(command[entry]).name, command[entry + 1 :], changed)


def split_flags(arguments: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """``--flag value ...`` pairs in order (a flag's values are the words up to the next ``--flag``)."""
    flags: List[Tuple[str, List[str]]] = []
    for word in arguments:
        if word.startswith("--"):
            flags.append((word, []))
        elif flags:
            flags[-1][1].append(word)
        else:
            raise ValueError(f"argument {word!r} comes before any --flag")
    return flags


def _join_flags(flags: Sequence[Tuple[str, List[str]]]) -> List[str]:
    return [word for flag, values in flags for word in (flag, *values)]


@dataclass
class CpuRun:
    """The arguments after the overrides, the world size they need, and one line per override applied."""

    arguments: List[str]
    world_size: int
    changes: List[str]


class _Overrides:
    """The script's flags as an ordered table, with a log of every change made to it."""

    def __init__(self, arguments: Sequence[str]):
        self.flags = split_flags(arguments)
        self.changes: List[str] = []

    def get(self, flag: str) -> Optional[List[str]]:
        return next((values for name, values in self.flags if name == flag), None)

    def set(self, flag: str, *values: str, add: bool = False) -> None:
        """Give ``flag`` these values where the script sets it (or append it, with ``add``)."""
        old = self.get(flag)
        if old is None and not add:
            return
        if old == list(values):
            return
        if old is None:
            self.flags.append((flag, list(values)))
        else:
            self.flags = [(name, list(values) if name == flag else vals) for name, vals in self.flags]
        before = "unset" if old is None else " ".join(old) or "(set)"
        self.changes.append(f"{flag}: {before} -> {' '.join(values) or '(set)'}")

    def drop(self, flag: str, why: str) -> None:
        old = self.get(flag)
        if old is not None:
            self.flags = [(name, vals) for name, vals in self.flags if name != flag]
            self.changes.append(f"{flag} {' '.join(old)}: dropped ({why})".replace("  ", " "))


def fit_to_cpu(arguments: Sequence[str], iterations: int, also_drop: Sequence[str] = ()) -> CpuRun:
    """Apply the overrides of this module's docstring to a Megatron-LM command line; ``also_drop`` names more flags
    to remove (to find out what else a failing script needs)."""
    run = _Overrides(arguments)
    for flag in also_drop:
        run.drop(flag, "asked for with --drop")
    for flag, tiny in TINY_SIZES.items():
        run.set(flag, tiny)
    _shrink_moe_layer_freq(run)
    world_size, data_parallel = _fit_layout(run)
    for flag in DROPPED_SCHEDULES:
        run.drop(flag, "batch-size ramp-up over a long run")
    run.set("--micro-batch-size", "1")
    run.set("--global-batch-size", str(2 * data_parallel), add=True)
    if run.get("--train-samples") is not None:
        run.set("--train-samples", str(iterations * 2 * data_parallel))
    else:
        run.set("--train-iters", str(iterations), add=True)
    run.set("--log-interval", "1", add=True)
    if int((run.get("--eval-iters") or ["100"])[0]) > 1:  # Megatron-LM's default is 100
        run.set("--eval-iters", "1", add=True)
    _use_mock_data(run)
    for flag, refused in GPU_ONLY_FLAGS.items():
        if refused is None or (run.get(flag) or [None])[0] in refused:
            run.drop(flag, "needs NVIDIA-only kernels")
    return CpuRun(_join_flags(run.flags), world_size, run.changes)


def _shrink_moe_layer_freq(run: _Overrides) -> None:
    """A per-layer MoE pattern such as ``[0]*3+[1]*58`` must have one entry per layer: keep the first ones."""
    values, layers = run.get("--moe-layer-freq"), run.get("--num-layers")
    if not values or not values[0].startswith("[") or layers is None:
        return
    pattern = []
    for run_of in values[0].split("+"):
        match = re.fullmatch(r"\[([\d,\s]+)\](?:\*(\d+))?", run_of.strip())
        if match is None:
            raise ValueError(f"--moe-layer-freq {values[0]}: expected a list like [0]*3+[1]*58")
        pattern += [int(x) for x in match.group(1).split(",")] * int(match.group(2) or 1)
    run.set("--moe-layer-freq", "[" + ",".join(map(str, pattern[: int(layers[0])])) + "]")


def _fit_layout(run: _Overrides) -> Tuple[int, int]:
    """Parallel sizes above 1 become 2 (at most two of TP/PP/CP); return (world size, data-parallel size)."""
    sizes = {}
    for flag in PARALLEL_SIZES:
        wanted = int((run.get(flag) or ["1"])[0])
        sizes[flag] = 2 if wanted > 1 and sum(s > 1 for s in sizes.values()) < 2 else 1
        run.set(flag, str(sizes[flag]))
    tp, pp, cp = sizes.values()
    expert_parallel = 2 if int((run.get("--expert-model-parallel-size") or ["1"])[0]) > 1 else 1
    run.set("--expert-model-parallel-size", str(expert_parallel))
    expert_tp = int((run.get("--expert-tensor-parallel-size") or [str(tp)])[0])
    # Experts are spread over TP x CP x DP ranks of a stage: the data-parallel size makes room for EP x ETP.
    data_parallel = max(1, expert_parallel * expert_tp // (tp * cp))
    if tp * pp * cp * data_parallel < 2:
        data_parallel = 2
    return tp * pp * cp * data_parallel, data_parallel


def _use_mock_data(run: _Overrides) -> None:
    for flag in DATA_PATHS:
        run.drop(flag, "replaced by --mock-data")
    run.set("--mock-data", add=True)
    missing = [flag for flag in TOKENIZER_FILES if run.get(flag) and not Path(run.get(flag)[0]).exists()]
    # A script without --tokenizer-type fails in Megatron-LM 0.19 too (its build_tokenizer refuses None).
    if missing or run.get("--tokenizer-type") is None:
        why = "tokenizer files not on this machine" if missing else "the script names no --tokenizer-type"
        for flag in TOKENIZER_FILES:
            run.drop(flag, why)
        run.set("--tokenizer-type", "NullTokenizer", add=True)
        run.set("--vocab-size", TINY_SIZES["--vocab-size"], add=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_command(launch: Launch, run: CpuRun) -> List[str]:
    """``torch.distributed.run`` on this machine: the script's launcher options are replaced by a local rendezvous."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(run.world_size),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(REPO_ROOT / launch.entry_point),
        *run.arguments,
    ]


@dataclass
class Outcome:
    returncode: int
    reached_training_loop: bool
    output: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and self.reached_training_loop


def run_on_cpu(launch: Launch, run: CpuRun, workdir: Path, timeout_s: float) -> Outcome:
    """Start the job in ``workdir`` (where the script's relative paths point) with one thread per rank."""
    env = {**os.environ, **launch.environment, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        cpu_command(launch, run),
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        output += f"\n[run_megatron_example] timed out after {timeout_s:.0f} s"
    return Outcome(process.returncode, bool(FIRST_ITERATION.search(output)), output)


def run_example(
    script: Path,
    script_args: Sequence[str],
    iterations: int = 3,
    timeout_s: float = 300,
    env=None,
    workdir=None,
    also_drop: Sequence[str] = (),
) -> Tuple[Launch, CpuRun, Outcome]:
    """Capture ``script``'s launch, fit it to CPU ranks and run it; ``workdir`` (default: a new temporary folder)
    is where the script and the job run."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="megatron-example-"))
    launch = capture_launch(Path(script).resolve(), script_args, workdir, {**os.environ, **(env or {})})
    if not (REPO_ROOT / launch.entry_point).exists():
        raise RuntimeError(f"{script} launches {launch.entry_point}, which this repository does not have")
    run = fit_to_cpu(launch.arguments, iterations, also_drop)
    return launch, run, run_on_cpu(launch, run, workdir, timeout_s)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], usage="%(prog)s [options] SCRIPT [-- SCRIPT_ARGS ...]"
    )
    parser.add_argument("script", type=Path, help="a Megatron-LM launch script (bash)")
    parser.add_argument("--iterations", type=int, default=3, help="training iterations to run (default 3)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the job is killed")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="set for the script")
    parser.add_argument("--drop", action="append", default=[], metavar="FLAG", help="also remove this flag")
    parser.add_argument("--workdir", type=Path, help="where the script runs (default: a new temporary folder)")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the launch script (which may have --options of its own).
    script_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    options = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    env = dict(item.split("=", 1) for item in options.env)
    launch, run, outcome = run_example(
        options.script, script_args, options.iterations, options.timeout, env, options.workdir, options.drop
    )
    print(outcome.output)
    print(f"[run_megatron_example] {options.script.name} launches {launch.entry_point} on {run.world_size} CPU ranks")
    for change in run.changes:
        print(f"[run_megatron_example]   {change}")
    verdict = "PASS: reached the training loop and exited 0" if outcome.passed else "FAIL"
    print(f"[run_megatron_example] {verdict} (exit status {outcome.returncode})")
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    from megatron.training.error_handling import tool_main

    tool_main(main)
