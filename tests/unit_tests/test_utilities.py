"""Multi-rank test harness: run a test function on N CPU ranks (gloo) from inside one pytest process.

``run_distributed(world_size, fn, *args)`` runs the module-level function ``fn(*args)`` on ``world_size`` ranks
that already have ``torch.distributed`` initialised (gloo, one thread each) and returns the list of per-rank return
values. Ranks are long-lived worker processes started once from a ``forkserver`` with torch preloaded, so a 4-rank
test costs a fraction of a second instead of seconds of interpreter start-up. A failure on any rank raises
:class:`DistributedTestError` carrying that rank's traceback; a hang becomes a failure after ``timeout`` seconds
naming the ranks that did not finish. Either way the pool's workers are replaced, so one bad test cannot poison
the next.

``Utils`` mirrors Megatron's test helper: ``Utils.initialize_model_parallel(tp, pp, ...)`` inside a rank function.
"""

import atexit
import importlib.util
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[2])
DEFAULT_TIMEOUT_S = 120
_GRACE_AFTER_FAILURE_S = 3


class DistributedTestError(AssertionError):
    """A rank raised, or ranks hung, while running a distributed test function."""


def _load_function(path: str, name: str):
    module_name = "_mp_test_" + str(abs(hash(path)))
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(module, name)


def _worker_main(conn) -> None:
    """Loop: receive a job, join its process group, run it, report, leave the group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    while True:
        job = conn.recv()
        if job is None:
            return
        rank, world_size, port, path, name, args, timeout = job
        try:
            try:
                dist.init_process_group(
                    "gloo",
                    init_method=f"tcp://127.0.0.1:{port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timedelta(seconds=timeout),
                )
            except BaseException:
                conn.send(("init_error", traceback.format_exc()))
                continue
            result = _load_function(path, name)(*args)
            conn.send(("ok", result))
        except BaseException:  # report everything, including assertion failures and SystemExit
            conn.send(("error", traceback.format_exc()))
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
            # initialize_megatron sizes the thread pool per rank; the next job must find the worker as it started
            # (one thread), or its floating-point results would depend on which tests ran before it.
            torch.set_num_threads(1)


class _Pool:
    def __init__(self):
        self.context = mp.get_context("forkserver")
        # Workers fork from a server that has imported these, so a fresh worker (after a failure, or recycled) starts
        # in a fraction of a second.
        self.context.set_forkserver_preload(["torch", "torch.distributed", "megatron.core.models.gpt"])
        self.workers = []  # (process, connection)

    def _ensure(self, count: int) -> None:
        while len(self.workers) < count:
            parent, child = self.context.Pipe()
            process = self.context.Process(target=_worker_main, args=(child,), daemon=True)
            process.start()
            child.close()
            self.workers.append((process, parent))

    def restart_all(self) -> None:
        """Replace every worker. Groups a job leaves behind in a worker (torch keeps some alive after
        ``destroy_process_group``) stay connected to the other workers; when one of those is killed, their gloo loops
        spin on the dead sockets, one core-hungry thread per group. So a failure replaces all workers at once, and so
        does a build-up of leftover threads (:meth:`recycle_if_leaking`)."""
        for process, conn in self.workers:
            process.kill()
        for process, conn in self.workers:
            process.join()
            conn.close()
        self.workers = []

    def recycle_if_leaking(self) -> None:
        if any(_thread_count(process.pid) > _MAX_WORKER_THREADS for process, _ in self.workers):
            self.close()

    def close(self) -> None:
        for process, conn in self.workers:
            try:
                conn.send(None)
            except OSError:
                pass
        for process, _ in self.workers:
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
        self.workers = []

    def run(self, world_size: int, fn, args, timeout: float, retries_left: int = 2):
        self._ensure(world_size)
        path, name = fn.__code__.co_filename, fn.__name__
        if fn.__qualname__ != name:
            raise TypeError(f"run_distributed needs a module-level function, got {fn.__qualname__}")
        port = _free_port()
        conns = {}
        for rank in range(world_size):
            process, conn = self.workers[rank]
            conn.send((rank, world_size, port, path, name, args, timeout))
            conns[conn] = rank
        results, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            pending = [c for c, r in conns.items() if r not in results and r not in errors]
            remaining = deadline - time.monotonic()
            if errors:
                remaining = min(remaining, _GRACE_AFTER_FAILURE_S)
            ready = wait(pending, timeout=max(remaining, 0))
            if not ready:
                break
            for conn in ready:
                rank = conns[conn]
                try:
                    status, payload = conn.recv()
                except (EOFError, ConnectionError):
                    self.workers[rank][0].join(timeout=1)
                    status, payload = "error", f"worker process died (exit code {self.workers[rank][0].exitcode})"
                if status == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = (status, payload)
        hung = [r for r in range(world_size) if r not in results and r not in errors]
        if errors or hung:
            self.restart_all()
            if retries_left and any(status == "init_error" for status, _ in errors.values()):
                # Joining the process group failed before the test ran (a port taken in the meantime, a peer's
                # connection refused): nothing of the test has happened yet, so run it again on a fresh port.
                return self.run(world_size, fn, args, timeout, retries_left - 1)
            message = []
            for i, (rank, (_, error)) in enumerate(errors.items()):  # in arrival order: the first is the cause
                message.append(f"--- rank {rank} failed{' first' if i == 0 else ''} ---\n{error}")
            if hung and not errors:
                message.append(f"ranks {hung} did not finish within {timeout:.0f} s (hang?)")
            elif hung:
                message.append(f"ranks {hung} were stopped after rank {next(iter(errors))} failed")
            raise DistributedTestError(f"{name} on {world_size} ranks:\n" + "\n".join(message))
        self.recycle_if_leaking()
        return [results[rank] for rank in range(world_size)]


# A fresh worker runs ~5 threads, a job's process groups add 3-4 gloo threads each while they live.
_MAX_WORKER_THREADS = 150


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:  # no /proc (not Linux) or the process is gone
        return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_POOL = None


def run_distributed(world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT_S):
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results in rank order."""
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
        atexit.register(_POOL.close)
    return _POOL.run(world_size, fn, args, timeout)


class Utils:
    """Megatron's test helper, for use inside a function run by :func:`run_distributed`."""

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ):
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, **kwargs
        )

    @staticmethod
    def destroy_model_parallel():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()

    @staticmethod
    def world_size():
        import torch.distributed as dist

        return dist.get_world_size()

    @staticmethod
    def rank():
        import torch.distributed as dist

        return dist.get_rank()
