"""Every command-line tool, run as a user runs it (a subprocess) on bad input, ends with one ``error:`` line that
names the file or flag, then the hint that gives the traceback; exit status 1 and no traceback. With
MEGATRON_LITE_VERBOSE_ERRORS=1 the traceback comes back."""

import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.error_handling import VERBOSE_ERRORS_ENV

REPO_ROOT = Path(__file__).resolve().parents[3]
BUILTIN = REPO_ROOT / "megatron" / "training" / "builtin_data"
TINY_MODEL = [
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
HINT = f"  (set {VERBOSE_ERRORS_ENV}=1 for the traceback)"


def run_tool(script, *arguments, verbose=False):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(VERBOSE_ERRORS_ENV, None)
    if verbose:
        env[VERBOSE_ERRORS_ENV] = "1"
    command = [sys.executable, str(REPO_ROOT / script), *map(str, arguments)]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT, env=env)


def assert_one_line_error(result, *fragments, hint=True):
    """The run failed, its output ends with one ``error:`` line holding every fragment (and the hint line), and it
    printed no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output, output
    lines = result.stderr.rstrip("\n").splitlines()
    error_lines = [line for line in lines if line.startswith("error:")]
    assert len(error_lines) == 1, output
    assert lines[-2:] == [error_lines[0], HINT] if hint else lines[-1] == error_lines[0], output
    for fragment in fragments:
        assert fragment in error_lines[0], output


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2 in Hugging Face's layout (config.json, model.safetensors, tokenizer files)."""
    from tokenizers import Tokenizer

    from tests.unit_tests.models.huggingface.hf_test_models import save_hf_model
    from tests.unit_tests.tokenizers.tiny_tokenizer_files import write_huggingface_dir

    directory = write_huggingface_dir(tmp_path_factory.mktemp("tool_errors") / "hf")
    vocab = Tokenizer.from_file(os.path.join(directory, "tokenizer.json")).get_vocab_size()
    save_hf_model("qwen2", directory, vocab_size=vocab)
    return Path(directory)


def _damaged_copy(hf_dir, tmp_path, damage):
    import shutil

    copy = tmp_path / "hf"
    shutil.copytree(hf_dir, copy)
    weights = copy / "model.safetensors"
    with open(weights, "r+b") as file:
        damage(file, weights.stat().st_size)
    return copy, weights


def _truncate(file, size):
    file.truncate(size // 2)


def _garble_header(file, size):
    file.seek(3)  # inside the 8-byte header length: it now claims a header far larger than the file
    file.write(b"\xff" * 16)


@pytest.mark.parametrize("damage", [_truncate, _garble_header], ids=["truncated", "garbled-header"])
def test_converter_names_a_damaged_safetensors_file(hf_dir, tmp_path, damage):
    source, weights = _damaged_copy(hf_dir, tmp_path, damage)
    arguments = ["--model-type", "GPT", "--loader", "hf", "--saver", "core", "--load-dir", source]
    result = run_tool("tools/checkpoint/convert.py", *arguments, "--save-dir", tmp_path / "out")
    assert_one_line_error(result, f"{weights} is not a valid safetensors file", "convert it again")
    assert not (tmp_path / "out").exists()


def _checkpoint_with_unsafe_pickle(directory: Path) -> Path:
    """A Megatron checkpoint whose DCP .metadata would run ``os.system`` if unpickled."""

    class RunsCode:
        def __reduce__(self):
            return (os.system, ("echo unpickled",))

    release = directory / "release"
    release.mkdir(parents=True)
    (directory / "latest_checkpointed_iteration.txt").write_text("release")
    (release / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (release / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    return release / ".metadata"


def test_converter_refuses_an_unsafe_pickle_in_one_line(tmp_path):
    metadata = _checkpoint_with_unsafe_pickle(tmp_path / "megatron")
    arguments = ["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", tmp_path / "megatron"]
    result = run_tool("tools/checkpoint/convert.py", *arguments, "--save-dir", tmp_path / "out")
    assert_one_line_error(result, f"{metadata} holds an object of posix.system", "not in the allow-list")
    assert "unpickled" not in result.stdout


def test_verbose_errors_bring_the_traceback_back(tmp_path):
    _checkpoint_with_unsafe_pickle(tmp_path / "megatron")
    arguments = ["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", tmp_path / "megatron"]
    result = run_tool("tools/checkpoint/convert.py", *arguments, "--save-dir", tmp_path / "out", verbose=True)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr and "posix.system" in result.stderr


def test_server_names_a_port_in_use_in_one_line(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        arguments = [*TINY_MODEL, "--load", tmp_path, "--host", "127.0.0.1", "--port", port]
        result = run_tool("tools/run_text_generation_server.py", *arguments)
    assert_one_line_error(result, f"--host 127.0.0.1 --port {port}: cannot listen there", "pick another --port")


def test_preprocess_data_names_a_missing_input(tmp_path):
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", BUILTIN / "vocab.json"]
    tokenizer += ["--merge-file", BUILTIN / "merges.txt", "--workers", "1"]
    missing = tmp_path / "absent.jsonl"
    result = run_tool("tools/preprocess_data.py", "--input", missing, "--output-prefix", tmp_path / "out", *tokenizer)
    assert_one_line_error(result, f"--input {missing}: no input files")


def test_merge_datasets_names_an_input_without_datasets(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_tool("tools/merge_datasets.py", "--input", empty, "--output-prefix", tmp_path / "merged")
    assert_one_line_error(result, f"--input {empty}: no .bin/.idx pairs to merge")


def test_train_tokenizer_names_the_bad_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "to be"}\n{not json\n')
    result = run_tool("tools/train_tokenizer.py", "--input", corpus, "--output-dir", tmp_path / "tokenizer")
    assert_one_line_error(result, f"{corpus}:2: not valid JSON")


def test_text_generation_cli_names_a_server_it_cannot_reach():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again below: nothing listens there
    result = run_tool("tools/text_generation_cli.py", f"127.0.0.1:{port}", "--prompt", "hi")
    # The client is standard library only: the same error line, without the hint about megatron's tracebacks.
    assert_one_line_error(result, f"http://127.0.0.1:{port}: cannot reach the text generation server", hint=False)


def test_report_theoretical_memory_names_the_flags():
    flags = [*TINY_MODEL, "--micro-batch-size", "1", "--num-attention-heads", "5"]
    result = run_tool("tools/report_theoretical_memory.py", *flags)
    assert_one_line_error(result, "--hidden-size (32) is not divisible by --num-attention-heads (5)")


def test_pretrain_gpt_run_as_one_process_ends_in_one_line(tmp_path):
    flags = [*TINY_MODEL, "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]
    result = run_tool("pretrain_gpt.py", *flags, "--load", tmp_path / "absent", "--exit-on-missing-checkpoint")
    assert_one_line_error(result, f"--exit-on-missing-checkpoint: no checkpoint in {tmp_path / 'absent'}")
