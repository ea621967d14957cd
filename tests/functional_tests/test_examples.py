"""The launch scripts in examples/: valid bash, and every flag they pass is one pretrain_gpt.py accepts.

The GPU scripts cannot run here, so each is executed with stand-ins for `torchrun`, `srun` and `scontrol` first on
PATH: the stand-in `torchrun` records its command line instead of launching. The recorded pretrain_gpt.py arguments
then go through `parse_args` (a misspelled flag fails) and `validate_args` at the world size the launcher would
start (an inconsistent layout or batch fails), with the built-in corpus standing in for the data. The CPU
quickstart also runs for real, shortened to two iterations.
"""

import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest

from megatron.training import builtin_data
from megatron.training.arguments import parse_args_list, validate_args
from tests.functional_tests.harness import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"
CPU_QUICKSTART = EXAMPLES / "cpu" / "train_gpt_cpu.sh"
GPT3 = EXAMPLES / "gpt3" / "train_gpt3_125m_distributed.sh"
LLAMA3 = EXAMPLES / "llama" / "train_llama3_8b.sh"
SLURM = EXAMPLES / "slurm" / "sbatch_gpt.sh"
MIXTRAL = EXAMPLES / "mixtral" / "train_mixtral_8x7b_distributed.sh"
MIXTRAL_CPU = EXAMPLES / "mixtral" / "train_mixtral_cpu.sh"
TINY_GPT = EXAMPLES / "inference" / "train_tiny_gpt.sh"
SERVE_TINY_GPT = EXAMPLES / "inference" / "serve_tiny_gpt.sh"
GPT3_SIZES = ["125M", "350M", "1.3B", "2.7B", "6.7B", "13B", "175B"]

_STAND_INS = {
    # Records the command line, NUL-separated, instead of starting anything.
    "torchrun": 'printf "%s\\0" "$@" > "$CAPTURED_COMMAND"',
    # `srun [options] command ...` runs the command (here: once, on this machine).
    "srun": 'while [[ "${1:-}" == -* ]]; do shift; done; exec "$@"',
    "scontrol": 'printf "node-a\\nnode-b\\n"',
}


SCRIPTS = [CPU_QUICKSTART, GPT3, LLAMA3, SLURM, MIXTRAL, MIXTRAL_CPU, TINY_GPT, SERVE_TINY_GPT]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_example_is_valid_bash(script):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


@pytest.fixture
def stand_in_path(tmp_path) -> dict:
    """Environment with the stand-ins first on PATH and CAPTURED_COMMAND naming the file torchrun writes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in _STAND_INS.items():
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    env = dict(os.environ)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", CAPTURED_COMMAND=str(tmp_path / "torchrun_command"))
    return env


def _launch_with_stand_ins(script, env, args=(), extra_env=None):
    """Run the script with the stand-ins; return (torchrun options, pretrain_gpt.py arguments)."""
    env = {**env, **(extra_env or {})}
    ran = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, f"{script.name} failed:\n{ran.stdout}\n{ran.stderr}"
    command = Path(env["CAPTURED_COMMAND"]).read_text().split("\0")[:-1]
    entry = next(i for i, arg in enumerate(command) if arg.endswith("pretrain_gpt.py"))
    assert Path(command[entry]) == REPO_ROOT / "pretrain_gpt.py"
    return command[:entry], command[entry + 1 :]


def _launcher_world_size(launcher_args) -> int:
    def option(name, default):
        return int(launcher_args[launcher_args.index(name) + 1]) if name in launcher_args else default

    return option("--nproc_per_node", 1) * option("--nnodes", 1)


def _parse_and_validate(megatron_args, world_size, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    try:
        args = parse_args_list(megatron_args)
    except SystemExit:
        pytest.fail(f"pretrain_gpt.py rejects the arguments (see the usage error above): {' '.join(megatron_args)}")
    with warnings.catch_warnings():
        # Validated on this CPU machine, GPU scripts get the expected "nccl -> gloo, no fused kernels" warning.
        warnings.simplefilter("ignore", UserWarning)
        return validate_args(args)


def _gpt2_style_inputs():
    return [builtin_data.vocab_file(), builtin_data.merge_file(), builtin_data.data_prefix()]


@pytest.mark.parametrize("model_size", GPT3_SIZES)
def test_gpt3_script_flags_parse_and_validate(model_size, stand_in_path, tmp_path, monkeypatch):
    launcher, megatron_args = _launch_with_stand_ins(
        GPT3,
        stand_in_path,
        [str(tmp_path / "ckpt"), str(tmp_path / "tb"), *_gpt2_style_inputs()],
        {"MODEL_SIZE": model_size},
    )
    args = _parse_and_validate(megatron_args, _launcher_world_size(launcher), monkeypatch)
    # The GPT-3 paper's shapes: d_head x heads is the attention width; FFN is 4 x d_model.
    expected = {
        "125M": (12, 768, 12),
        "350M": (24, 1024, 16),
        "1.3B": (24, 2048, 24),
        "2.7B": (32, 2560, 32),
        "6.7B": (32, 4096, 32),
        "13B": (40, 5120, 40),
        "175B": (96, 12288, 96),
    }[model_size]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == expected
    assert args.ffn_hidden_size == 4 * args.hidden_size and args.seq_length == 2048
    assert args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) == 0


def test_gpt3_script_rejects_an_unknown_size(stand_in_path, tmp_path):
    ran = subprocess.run(
        ["bash", str(GPT3), "a", "b", "c", "d", "e"],
        env={**stand_in_path, "MODEL_SIZE": "7B"},
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 2 and "unknown MODEL_SIZE=7B" in ran.stderr


def test_llama3_script_flags_parse_and_validate(stand_in_path, tmp_path, monkeypatch):
    launcher, megatron_args = _launch_with_stand_ins(
        LLAMA3,
        stand_in_path,
        extra_env={
            "TOKENIZER_MODEL": str(tmp_path / "Meta-Llama-3-8B"),
            "DATA_PREFIX": builtin_data.data_prefix(),
            "CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        },
    )
    args = _parse_and_validate(megatron_args, _launcher_world_size(launcher), monkeypatch)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (32, 4096, 14336)
    assert (args.num_attention_heads, args.num_query_groups, args.kv_channels) == (32, 8, 128)
    assert args.group_query_attention and args.swiglu and args.normalization == "RMSNorm"
    assert args.position_embedding_type == "rope" and args.rotary_base == 500000 and args.use_rope_scaling
    assert args.untie_embeddings_and_output_weights and not args.add_bias_linear
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model.endswith("Meta-Llama-3-8B")


def test_llama3_script_requires_its_tokenizer(stand_in_path):
    ran = subprocess.run(["bash", str(LLAMA3)], env=stand_in_path, capture_output=True, text=True)
    assert ran.returncode != 0 and "TOKENIZER_MODEL" in ran.stderr


def test_mixtral_8x7b_script_flags_parse_and_validate(stand_in_path, tmp_path, monkeypatch):
    launcher, megatron_args = _launch_with_stand_ins(
        MIXTRAL,
        stand_in_path,
        extra_env={
            "TOKENIZER_MODEL": str(tmp_path / "tokenizer.model"),
            "DATA_PREFIX": builtin_data.data_prefix(),
            "CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        },
    )
    args = _parse_and_validate(megatron_args, _launcher_world_size(launcher), monkeypatch)
    assert args.world_size == 64 and (args.pipeline_model_parallel_size, args.expert_model_parallel_size) == (4, 8)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_query_groups) == (32, 4096, 14336, 8)
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (8, 2, 14336)
    assert args.moe_token_dispatcher_type == "alltoall" and args.moe_grouped_gemm and args.moe_aux_loss_coeff == 1e-2


def test_mixtral_cpu_script_flags_parse_and_validate(stand_in_path, tmp_path, monkeypatch):
    launcher, megatron_args = _launch_with_stand_ins(
        MIXTRAL_CPU, stand_in_path, extra_env={"CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    )
    args = _parse_and_validate(megatron_args, _launcher_world_size(launcher), monkeypatch)
    assert (args.world_size, args.expert_model_parallel_size, args.num_experts) == (2, 2, 4)
    assert args.data_parallel_size == 2 and args.distributed_backend == "gloo"


def test_tiny_gpt_script_flags_validate_and_it_sets_one_thread(stand_in_path, tmp_path, monkeypatch):
    """One rank: torchrun would not set OMP_NUM_THREADS, so the script does (docs/inference.md says why)."""
    env = {key: value for key, value in stand_in_path.items() if key != "OMP_NUM_THREADS"}
    stand_in = Path(env["PATH"].split(os.pathsep)[0]) / "torchrun"
    stand_in.write_text(stand_in.read_text() + 'echo "$OMP_NUM_THREADS" > "$CAPTURED_COMMAND.threads"\n')
    launcher, megatron_args = _launch_with_stand_ins(TINY_GPT, env, extra_env={"CHECKPOINT_DIR": str(tmp_path / "c")})
    args = _parse_and_validate(megatron_args, _launcher_world_size(launcher), monkeypatch)
    assert (args.world_size, args.num_layers, args.hidden_size, args.log_interval) == (1, 2, 64, 20)
    assert Path(env["CAPTURED_COMMAND"] + ".threads").read_text().strip() == "1"


def test_slurm_script_launches_torchrun_per_node_with_a_rendezvous(stand_in_path, tmp_path, monkeypatch):
    vocab, merges, data = _gpt2_style_inputs()
    launcher, megatron_args = _launch_with_stand_ins(
        SLURM,
        stand_in_path,
        extra_env={
            "SLURM_JOB_NODELIST": "node-[a-b]",
            "SLURM_NNODES": "2",
            "SLURM_JOB_ID": "4242",
            "SLURM_SUBMIT_DIR": str(REPO_ROOT),
            "DATA_PREFIX": data,
            "VOCAB_FILE": vocab,
            "MERGE_FILE": merges,
            "CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        },
    )
    assert launcher[launcher.index("--rdzv_endpoint") + 1] == "node-a:29500"
    assert launcher[launcher.index("--rdzv_id") + 1] == "4242"
    assert launcher[launcher.index("--rdzv_backend") + 1] == "c10d"
    args = _parse_and_validate(megatron_args, _launcher_world_size(launcher), monkeypatch)
    assert args.world_size == 16 and args.tensor_model_parallel_size == 2 and args.data_parallel_size == 8
    sbatch_time = re.search(r"#SBATCH --time=(\d+):(\d+):\d+", SLURM.read_text())
    assert args.exit_duration_in_mins < int(sbatch_time.group(1)) * 60 + int(sbatch_time.group(2))


def test_cpu_quickstart_flags_parse_and_validate(stand_in_path, tmp_path, monkeypatch):
    launcher, megatron_args = _launch_with_stand_ins(
        CPU_QUICKSTART, stand_in_path, extra_env={"CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    )
    args = _parse_and_validate(megatron_args, _launcher_world_size(launcher), monkeypatch)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size) == (2, 2, 4)


def _run_quickstart(checkpoint_dir, tmp_path, train_iters):
    env = dict(os.environ)
    env.update(
        CHECKPOINT_DIR=str(checkpoint_dir),
        DATA_CACHE_DIR=str(tmp_path / "cache"),
        TRAIN_ITERS=str(train_iters),
        OMP_NUM_THREADS="1",
    )
    ran = subprocess.run(
        ["bash", str(CPU_QUICKSTART), "--eval-iters", "1", "--log-interval", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output[-4000:]
    assert re.search(rf"iteration\s+{train_iters}/\s+{train_iters} \|.*lm loss: ", output), output[-4000:]
    assert f"Checkpoint of iteration {train_iters} saved in {checkpoint_dir}" in ran.stdout
    assert (checkpoint_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(train_iters)
    assert "Warning" not in output, "the quickstart should run without warnings"
    return output


def test_cpu_quickstart_trains_and_says_where_it_saved_then_trains_further(tmp_path):
    """The documented way to continue: run the script again with a larger TRAIN_ITERS."""
    checkpoint_dir = tmp_path / "quickstart"
    _run_quickstart(checkpoint_dir, tmp_path, train_iters=2)
    resumed = _run_quickstart(checkpoint_dir, tmp_path, train_iters=3)
    assert "successfully loaded checkpoint" in resumed
    iterations = [int(i) for i in re.findall(r"iteration\s+(\d+)/\s+3 \|", resumed)]
    assert iterations == [3], resumed[-4000:]
