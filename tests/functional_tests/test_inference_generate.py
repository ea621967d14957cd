"""examples/inference/generate_from_checkpoint.py on a TP2 x PP2 training checkpoint, at TP1, TP2 and PP2: the
checkpoint is resharded on load and every layout generates the same greedy tokens with the same log-probs."""

import json

import pytest

from megatron.training import builtin_data
from tests.functional_tests.configs import EQUIVALENCE_FLAGS
from tests.functional_tests.harness import REPO_ROOT, run_pretrain

SCRIPT = REPO_ROOT / "examples" / "inference" / "generate_from_checkpoint.py"
MODEL_FLAGS = EQUIVALENCE_FLAGS[: EQUIVALENCE_FLAGS.index("--hidden-dropout")] + ["--use-cpu-initialization"]
LAYOUTS = [(1, []), (2, ["--tensor-model-parallel-size", "2"]), (2, ["--pipeline-model-parallel-size", "2"])]


def _generate(checkpoint_dir, nproc, layout_flags):
    flags = (
        MODEL_FLAGS
        + layout_flags
        + [
            "--distributed-backend",
            "gloo",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            builtin_data.vocab_file(),
            "--merge-file",
            builtin_data.merge_file(),
            "--load",
            checkpoint_dir,
            "--prompts",
            "ROMEO:",
            "First Citizen: Before we proceed any further,",
            "--num-tokens-to-generate",
            "6",
            "--top_k",
            "1",
            "--return-log-probs",
        ]
    )
    result = run_pretrain(flags, nproc, entry_point=SCRIPT)
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith('{"prompt"')]
    assert len(lines) == 2, result.describe()
    return lines


def test_generate_from_a_checkpoint_at_any_layout(tp2_pp2_run):
    outputs = [_generate(tp2_pp2_run.checkpoint_dir, nproc, flags) for nproc, flags in LAYOUTS]
    reference = outputs[0]
    for (nproc, flags), output in zip(LAYOUTS[1:], outputs[1:]):
        for expected, actual in zip(reference, output):
            assert actual["generated_tokens"] == expected["generated_tokens"], flags
            assert actual["generated_log_probs"] == pytest.approx(expected["generated_log_probs"], abs=1e-4), flags
    assert all(len(line["generated_tokens"]) == 6 for line in reference)
