"""The hybrid launch scripts in examples/mamba/: valid bash, and every flag they pass is one pretrain_hybrid.py
accepts and validates at the world size the launcher would start (run with test_examples' stand-in torchrun)."""

import os
import subprocess
import warnings
from pathlib import Path

import pytest

from megatron.training import builtin_data
from megatron.training.arguments import parse_args_list, validate_args
from pretrain_hybrid import hybrid_model_flags
from tests.functional_tests.harness import REPO_ROOT
from tests.functional_tests.test_examples import _launcher_world_size, stand_in_path  # noqa: F401  (fixture)
from tests.unit_tests.models.hybrid.test_hybrid_layer_allocation import PATTERN_8B

HYBRID_8B = REPO_ROOT / "examples" / "mamba" / "train_hybrid_8b.sh"
# Its flags are the ones tests/functional_tests/test_hybrid.py trains with, at a larger size; it is only checked
# for syntax here (its builtin-data lookups start three Python interpreters, too slow for the suite).
HYBRID_CPU = REPO_ROOT / "examples" / "mamba" / "train_hybrid_cpu.sh"


@pytest.mark.parametrize("script", [HYBRID_8B, HYBRID_CPU], ids=lambda p: p.name)
def test_hybrid_example_is_valid_bash(script):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def _validated_arguments(script, env, extra_env, monkeypatch):
    ran = subprocess.run(["bash", str(script)], env={**env, **extra_env}, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, f"{script.name} failed:\n{ran.stdout}\n{ran.stderr}"
    command = Path(env["CAPTURED_COMMAND"]).read_text().split("\0")[:-1]
    entry = next(i for i, arg in enumerate(command) if arg.endswith(".py"))
    assert Path(command[entry]) == REPO_ROOT / "pretrain_hybrid.py"
    monkeypatch.setenv("WORLD_SIZE", str(_launcher_world_size(command[:entry])))
    monkeypatch.setenv("RANK", "0")
    args = parse_args_list(command[entry + 1 :], extra_args_provider=hybrid_model_flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nccl -> gloo and the fused kernels on this CPU machine
        return validate_args(args)


def test_8b_hybrid_script_flags_parse_and_validate(stand_in_path, tmp_path, monkeypatch):  # noqa: F811
    args = _validated_arguments(
        HYBRID_8B,
        stand_in_path,
        {
            "TOKENIZER_MODEL": str(tmp_path / "tokenizer"),
            "DATA_PREFIX": builtin_data.data_prefix(),
            "CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        },
        monkeypatch,
    )
    assert args.hybrid_layer_pattern == PATTERN_8B and args.num_layers == 56 and args.is_hybrid_model
    assert (args.hidden_size, args.num_attention_heads, args.num_query_groups) == (4096, 32, 8)
    assert (args.mamba_state_dim, args.mamba_head_dim, args.mamba_num_groups) == (128, 64, 8)
    assert args.position_embedding_type == "none" and args.tensor_model_parallel_size == 4 and args.sequence_parallel
    assert args.world_size == 8 and args.data_parallel_size == 2
