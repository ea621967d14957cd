"""tools/run_text_generation_server.py's command line: pretrain_gpt.py's model flags without data or a training
length, the server's flags, and a clear error (before any process group exists) for each bad setting."""

import sys

import pytest

from megatron.training.global_vars import unset_global_variables
from tools.run_text_generation_server import _check_serving_args, max_sequence_length, parse_server_args

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "100",
    "--distributed-backend",
    "gloo",
]


@pytest.fixture
def parse(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)

    def parse_with(*flags, load=True):
        argv = MODEL + (["--load", str(tmp_path)] if load else []) + list(flags)
        monkeypatch.setattr(sys, "argv", ["run_text_generation_server.py", *argv])
        return parse_server_args()

    yield parse_with
    unset_global_variables()


def test_serving_flags_parse_without_data_or_training_length(parse, tmp_path):
    args = parse("--inference-max-requests", "4", "--inference-max-seq-length", "48", "--top_k", "1")
    _check_serving_args(args)
    assert (args.port, args.host, args.temperature, args.top_k, args.top_p) == (5000, "0.0.0.0", 1.0, 1, 0.0)
    assert (args.skip_train, args.no_load_optim, args.no_load_rng, args.exit_on_missing_checkpoint) == (
        True,
        True,
        True,
        True,
    )
    assert args.micro_batch_size == 1 and args.inference_max_requests == 4
    assert max_sequence_length(args) == 48
    assert (args.max_request_body_bytes, args.ignore_unknown_request_fields) == (4 * 1024 * 1024, False)
    limits = parse("--max-request-body-bytes", "0", "--ignore-unknown-request-fields")
    assert (limits.max_request_body_bytes, limits.ignore_unknown_request_fields) == (0, True)
    assert max_sequence_length(parse()) == 64  # the default 2560 is capped by --max-position-embeddings


@pytest.mark.parametrize(
    "flags,load,message",
    [
        ((), False, "--load is required"),
        (("--port", "70000"), True, "--port 70000: not a TCP port"),
        (("--temperature", "-1"), True, "need temperature >= 0"),
        (("--top_p", "1.5"), True, "0 <= top_p <= 1"),
        (("--inference-max-requests", "0"), True, "need at least 1 request"),
        (("--max-request-body-bytes", "-1"), True, "--max-request-body-bytes -1: need >= 0"),
        (("--chat-template", "/no/such/template.jinja"), True, "--chat-template /no/such/template.jinja: no such file"),
    ],
)
def test_bad_serving_flags_are_refused_with_the_flag_named(parse, flags, load, message):
    args = parse(*flags, load=load)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _check_serving_args(args)


def test_missing_checkpoint_directory_and_data_parallel_replicas_are_refused(parse, monkeypatch, tmp_path):
    args = parse()
    args.load = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="missing: no such directory"):
        _check_serving_args(args)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="runs one model replica.*DP 2"):
        _check_serving_args(parse())


def test_the_listening_socket_names_a_port_in_use_and_port_0_gets_a_free_one():
    from megatron.core.inference.text_generation_server.server import listen_socket

    with listen_socket("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        assert port > 0
        with pytest.raises(
            OSError,
            match=rf"--host 127.0.0.1 --port {port}: cannot listen there .*pick another "
            r"--port \(0: any free port\)",
        ):
            listen_socket("127.0.0.1", port)


def test_a_port_in_use_stops_the_server_before_it_loads_anything(tmp_path):
    """The tool binds its port right after the flags: it exits with the message before any process group or
    checkpoint, on a directory that holds no checkpoint at all."""
    import subprocess

    from megatron.core.inference.text_generation_server.server import listen_socket
    from tests.functional_tests.harness import REPO_ROOT

    with listen_socket("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                str(REPO_ROOT / "tools" / "run_text_generation_server.py"),
                *MODEL,
                "--load",
                str(tmp_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode != 0
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in result.stderr + result.stdout
    assert "checkpoint" not in (result.stderr + result.stdout).lower()


def test_the_listening_socket_says_tcp_so_asyncio_turns_nagle_off():
    """asyncio sets TCP_NODELAY only on sockets whose protocol is IPPROTO_TCP; without it every response's body
    waited for the client's delayed ACK of its headers (~40 ms a response, /health included)."""
    import socket

    from megatron.core.inference.text_generation_server.server import listen_socket

    with listen_socket("127.0.0.1", 0) as listener:
        assert listener.proto == socket.IPPROTO_TCP
