"""tools/run_text_generation_server.py end to end: a checkpoint saved by pretrain_gpt.py served at TP2 on two CPU
ranks (the checkpoint is resharded on load; rank 0 serves HTTP and the other rank steps in lockstep), answering
the official ``openai`` client and tools/text_generation_cli.py, with the same results as the same checkpoint
served on one rank."""

import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.functional_tests.configs import GOLDEN_FLAGS
from tests.functional_tests.harness import REPO_ROOT, PretrainProcess

SERVER = REPO_ROOT / "tools" / "run_text_generation_server.py"
CLI = REPO_ROOT / "tools" / "text_generation_cli.py"
PROMPT = "Friends, Romans, countrymen, lend me"


def _model_flags():
    """The golden run's model shape (no training flags: the server refuses none, but needs none)."""
    names = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--max-position-embeddings")
    flags = []
    for name in names:
        flags += [name, GOLDEN_FLAGS[GOLDEN_FLAGS.index(name) + 1]]
    return flags


class _Server:
    def __init__(self, checkpoint_dir, cpu_data_flags, nproc, model_flags, extra=()):
        tokenizer_flags = cpu_data_flags[cpu_data_flags.index("--tokenizer-type") :][:6]
        cpu_flags = [f for f in cpu_data_flags[: cpu_data_flags.index("--data-path")]]
        args = (
            list(model_flags)
            + cpu_flags
            + tokenizer_flags
            + [
                "--load",
                checkpoint_dir,
                "--port",
                "0",
                "--host",
                "127.0.0.1",
                "--top_k",
                "1",
                "--inference-max-requests",
                "4",
                *extra,
            ]
        )
        self.process = PretrainProcess(args, nproc, entry_point=SERVER)
        self.banner = self.process.wait_for_line(lambda line: line.startswith("serving '"), timeout=240)
        # --port 0: rank 0 listens on a free port, bound before the job starts, and the banner names it.
        self.url = re.search(r"on (http://127\.0\.0\.1:\d+)$", self.banner.strip()).group(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError as exc:
                if time.monotonic() > deadline:
                    self.process.kill()
                    raise AssertionError(f"the server never answered /health:\n{self.process.output[-4000:]}") from exc
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def stop(self):
        self.process.send_signal_to_group(signal.SIGINT)
        return self.process.wait(timeout=60)


def _greedy_with_prompt_log_probs(client):
    model = client.models.list().data[0].id
    choice = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=0
    ).choices[0]
    return choice.text, choice.logprobs.token_logprobs


def test_tp2_server_answers_like_the_single_rank_server(golden_run, cpu_data_flags):
    checkpoint = golden_run.checkpoint_dir
    # The TP2 server reads the model's shape from the checkpoint (which was saved at TP1) and keeps TP2.
    server = _Server(
        checkpoint,
        cpu_data_flags,
        nproc=2,
        model_flags=["--use-checkpoint-args"],
        extra=["--tensor-model-parallel-size", "2"],
    )
    try:
        assert " at TP=2 PP=1 " in server.banner
        text_tp2, log_probs_tp2 = _greedy_with_prompt_log_probs(server.client)
        assert text_tp2.startswith(PROMPT) and len(text_tp2) > len(PROMPT)
        chat = server.client.chat.completions.create(
            model=checkpoint.name,
            max_tokens=4,
            n=2,
            seed=5,
            temperature=1.0,
            messages=[{"role": "user", "content": "Speak."}],
        )
        assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
        # The CLI talks to PUT /api; with the server's --top_k 1 default it is greedy too.
        cli = subprocess.run(
            [
                sys.executable,
                str(CLI),
                server.url.removeprefix("http://"),
                "--prompt",
                PROMPT,
                "--tokens-to-generate",
                "6",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout == text_tp2 + "\n"
    finally:
        result = server.stop()
    # torchrun itself exits non-zero (with its own traceback) when signalled; its ranks must stop cleanly: rank 0
    # tells rank 1 to stop, and neither reports an error ("[rankN]: ..." lines).
    assert not re.search(r"^\[rank\d+\]:", result.output, re.MULTILINE), result.describe()

    single = _Server(checkpoint, cpu_data_flags, nproc=1, model_flags=_model_flags())
    try:
        text_tp1, log_probs_tp1 = _greedy_with_prompt_log_probs(single.client)
    finally:
        single.stop()
    assert text_tp2 == text_tp1
    assert log_probs_tp2[0] is None and log_probs_tp1[0] is None
    assert log_probs_tp2[1:] == pytest.approx(log_probs_tp1[1:], abs=1e-4)
