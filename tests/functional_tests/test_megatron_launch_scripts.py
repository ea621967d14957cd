"""Megatron-LM-style launch scripts run through tools/run_megatron_example.py: captured unchanged from bash, fitted
to CPU ranks with the tool's documented overrides, they reach the training loop and exit 0.

The scripts in megatron_style_scripts/ are this project's own, written in the style of Megatron-LM's examples/.
Set MEGATRON_LM_EXAMPLES to a Megatron-LM checkout's examples/ folder to run Megatron-LM's own scripts as well."""

import os
import sys
from pathlib import Path

import pytest

from megatron.training import builtin_data
from tests.functional_tests.harness import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import run_megatron_example as example  # noqa: E402

SCRIPTS = Path(__file__).with_name("megatron_style_scripts")
MEGATRON_EXAMPLES = os.environ.get("MEGATRON_LM_EXAMPLES")


def _gpt2_inputs(tmp_path):
    return [str(tmp_path / "ckpt"), str(tmp_path / "tb"), builtin_data.vocab_file(), builtin_data.merge_file(), "d"]


def _passes(script, script_args, tmp_path):
    launch, run, outcome = example.run_example(script, script_args, iterations=2, timeout_s=240, workdir=tmp_path)
    assert outcome.passed, f"{script.name} ({run.world_size} ranks, {run.changes}):\n{outcome.output[-4000:]}"
    return launch, run


def test_gpt_with_tensor_and_pipeline_parallelism(tmp_path):
    launch, run = _passes(SCRIPTS / "train_gpt_tp_pp.sh", _gpt2_inputs(tmp_path), tmp_path)
    assert run.world_size == 4 and "--fp16" in run.arguments and (tmp_path / "ckpt").is_dir()


def test_mamba_hybrid_from_its_examples_folder(tmp_path):
    launch, run = _passes(SCRIPTS / "train_hybrid_mamba.sh", ["corpus", "tokenizer.model"], tmp_path)
    assert launch.entry_point == "pretrain_hybrid.py" and (tmp_path / "checkpoints").is_dir()


def test_moe_with_fp8_flags_and_the_flex_dispatcher(tmp_path):
    _passes(SCRIPTS / "train_moe_fp8_mock.sh", [], tmp_path)


MEGATRON_SCRIPTS = {
    "gpt3/train_gpt3_175b_distributed.sh": "gpt2",
    "mixtral/train_mixtral_8x7b_distributed.sh": ["ckpt", "tokenizer.model", "data"],
    "mamba/train.sh": ["data", "tokenizer.model"],
    "llama/train_llama3_8b_h100_fp8.sh": [],  # mock data by default
}


@pytest.mark.skipif(not MEGATRON_EXAMPLES, reason="set MEGATRON_LM_EXAMPLES to Megatron-LM's examples/ folder")
@pytest.mark.parametrize("script", MEGATRON_SCRIPTS)
def test_megatron_lms_own_launch_script(script, tmp_path):
    args = MEGATRON_SCRIPTS[script]
    _passes(Path(MEGATRON_EXAMPLES) / script, _gpt2_inputs(tmp_path) if args == "gpt2" else args, tmp_path)
