"""Serve a dynamic inference engine over HTTP: rank 0 runs uvicorn, every other rank follows its engine steps.

    server = TextGenerationServer(engine, tokenizer, model_name="gpt", max_sequence_length=2048)
    server.run(host="0.0.0.0", port=5000)      # on every rank; returns when rank 0 is stopped (Ctrl-C / SIGTERM)

``tools/run_text_generation_server.py`` builds the engine from a checkpoint and calls this; tests use
:meth:`TextGenerationServer.start` / :meth:`stop` to run it in a thread of the test process.
"""

import logging
import signal
import socket
import threading
import time
from typing import Optional

import torch.distributed as dist

from megatron.core.inference.text_generation_server.app import create_app
from megatron.core.inference.text_generation_server.chat_template import build_chat_renderer
from megatron.core.inference.text_generation_server.serving_loop import ServingLoop
from megatron.core.inference.text_generation_server.validation import DEFAULT_MAX_REQUEST_BODY_BYTES, ServingDefaults

logger = logging.getLogger(__name__)


def control_group() -> Optional[dist.ProcessGroup]:
    """A gloo group over every rank for the serving loop's broadcasts (CPU tensors work with any model backend);
    None in a single-process run. Collective: every rank calls it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


class _signals_deferred_to_rank_0:
    """On a following rank: SIGINT / SIGTERM are noted, not acted on (rank 0's stop turn ends the loop)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    @staticmethod
    def _note(signum, _frame):
        logger.info("received %s: waiting for rank 0 to stop the server", signal.Signals(signum).name)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (``port`` 0: a free one, see ``getsockname()``), for uvicorn to serve on.

    The server tool binds it before the model loads: a port in use is reported at once instead of after minutes of
    loading, and no port is released between choosing it and serving on it (where another socket, say one of gloo's,
    could take it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Protocol IPPROTO_TCP, not create_server's 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    # that say TCP, and with it on, every response's body waits for the client's delayed ACK of its headers (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        return sock
    except OSError as exc:
        sock.close()
        error = OSError(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); pick another --port "
            "(0: any free port), or stop what is using it"
        )
        error.errno = exc.errno  # EADDRINUSE: reported as bad input (one line), not as a crash
        raise error from exc


class TextGenerationServer:
    """The OpenAI-compatible server around one engine (see the module docstring)."""

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        model_name: str,
        max_sequence_length: int,
        defaults: Optional[ServingDefaults] = None,
        chat_template_file: Optional[str] = None,
        group: Optional[dist.ProcessGroup] = None,
        vocab_size: Optional[int] = None,
        termination_id: Optional[int] = None,
        max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
        ignore_unknown_fields: bool = False,
    ):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.serving_loop = ServingLoop(engine, group=group)
        self.app = None
        if self.rank == 0:
            self.app = create_app(
                self.serving_loop,
                tokenizer,
                model_name,
                max_sequence_length,
                defaults,
                build_chat_renderer(tokenizer, chat_template_file),
                termination_id,
                vocab_size,
                max_request_body_bytes=max_request_body_bytes,
                ignore_unknown_fields=ignore_unknown_fields,
            )
        self._uvicorn = None
        self._thread: Optional[threading.Thread] = None

    def run(self, host: str = "0.0.0.0", port: int = 5000, sock: Optional[socket.socket] = None) -> None:
        """Serve until SIGINT / SIGTERM (rank 0), or follow rank 0's engine steps until it stops (other ranks).

        Rank 0 serves on ``sock`` when given (a :func:`listen_socket` bound before the model loaded), else on a
        socket it binds to ``host:port`` now. A job is stopped through rank 0: Ctrl-C (or the launcher's SIGTERM)
        reaches every rank, but the other ranks only note it and keep following, so rank 0 can finish its step and
        tell them to stop; every rank then returns normally."""
        if self.rank != 0:
            with _signals_deferred_to_rank_0():
                self.serving_loop.follow()
            return
        import uvicorn

        sock = sock or listen_socket(host, port)
        self.serving_loop.start()
        try:
            logger.info("text generation server listening on http://%s:%d", *sock.getsockname()[:2])
            config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5)
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the signal it stopped on, once it has stopped
            pass
        finally:
            self.serving_loop.shutdown()

    def start(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> str:
        """Rank 0 only: serve from a background thread; returns the base URL (``port=0``: a free port)."""
        import uvicorn

        sock = listen_socket(host, port)
        port = sock.getsockname()[1]
        self.serving_loop.start()
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the text generation server did not start on {host}:{port}")
            time.sleep(0.02)
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(30)
        self.serving_loop.shutdown()
