"""tools/checkpoint/convert.py end to end: HF -> Megatron checkpoint -> pretrain_gpt.py fine-tuning at TP2 x PP2
(--load --finetune --use-checkpoint-args) -> HF again, which transformers loads; the same for a NemotronH hybrid
with --model-type hybrid and pretrain_hybrid.py at TP2; the flags it refuses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.functional_tests.harness import CPU_FLAGS, torchrun_command
from tests.unit_tests.models.huggingface.hf_test_models import save_hf_model
from tests.unit_tests.tokenizers.tiny_tokenizer_files import write_huggingface_dir

REPO_ROOT = Path(__file__).resolve().parents[3]
CONVERT = REPO_ROOT / "tools" / "checkpoint" / "convert.py"


def run(command, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env)


def convert(*arguments, model_type="GPT"):
    return run([sys.executable, str(CONVERT), "--model-type", model_type, *map(str, arguments)])


def finetune(load_flags, save_dir, lr, tokenizer_dir, nproc=4, entry_point=None):
    """Two iterations of pretrain_gpt.py (or ``entry_point``) on ``nproc`` ranks; the model flags, the layout and
    the tokenizer type come from the checkpoint."""
    flags = [
        *load_flags,
        "--use-checkpoint-args",
        "--use-mp-args-from-checkpoint-args",
        "--tokenizer-model",
        tokenizer_dir,
        "--mock-data",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
        "--train-iters",
        "2",
        "--lr",
        str(lr),
        "--min-lr",
        "0",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--save",
        save_dir,
        "--save-interval",
        "2",
        *CPU_FLAGS,
    ]
    command = (
        torchrun_command(flags, nproc=nproc)
        if entry_point is None
        else torchrun_command(flags, nproc=nproc, entry_point=entry_point)
    )
    return run(command, timeout=300)


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """A tiny Qwen2 (tied embeddings, QKV bias) with a tokenizer of matching vocabulary."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("convert_cli")
    hf_dir = write_huggingface_dir(root / "hf")
    vocab = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json")).get_vocab_size()
    save_hf_model("qwen2", hf_dir, vocab_size=vocab)
    return root, hf_dir


def _load(directory):
    from safetensors.torch import load_file

    files = [name for name in os.listdir(directory) if name.endswith(".safetensors")]
    return {name: tensor for file in files for name, tensor in load_file(os.path.join(directory, file)).items()}


def _megatron_logits(megatron_dir, input_ids):
    """Logits of the GPTModel / HybridModel (TP = PP = 1) loaded from a Megatron checkpoint through its
    --use-checkpoint-args."""
    import argparse

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.core.models.huggingface.config import (
        model_class_and_kwargs,
        settings_from_checkpoint_args,
        transformer_config_from_settings,
    )
    from megatron.training.checkpointing import find_checkpoint_to_load

    parallel_state.initialize_model_parallel()
    checkpoint_dir = find_checkpoint_to_load(megatron_dir)[0]
    args = load_common_state_dict(checkpoint_dir)["args"]
    settings = settings_from_checkpoint_args(argparse.Namespace(**{**vars(args), "tokenizer_type": None}))
    model_class, kwargs = model_class_and_kwargs(settings)
    model = model_class(
        transformer_config_from_settings(settings, use_cpu_initialization=True),
        **{**kwargs, "vocab_size": args.padded_vocab_size},
    ).eval()
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, checkpoint_dir)
    model.load_state_dict(state["model"])
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
    with torch.no_grad():
        return model(input_ids, positions, None)


def test_convert_finetune_and_export(hf_source):
    import transformers

    from tests.unit_tests.test_utilities import run_distributed

    root, hf_dir = hf_source
    megatron_dir = str(root / "megatron")
    result = convert(
        "--loader",
        "hf",
        "--saver",
        "core",
        "--load-dir",
        hf_dir,
        "--save-dir",
        megatron_dir,
        "--target-tensor-parallel-size",
        "2",
        "--target-pipeline-parallel-size",
        "2",
    )
    assert result.returncode == 0, result.stderr
    tokenizer_dir = os.path.join(megatron_dir, "hf_tokenizer")
    assert sorted(os.listdir(tokenizer_dir)) == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]

    # Fine-tune at TP2 x PP2 (the layout the checkpoint's args say), save, export the result to HF.
    tuned_dir = str(root / "tuned")
    result = finetune(["--load", megatron_dir, "--finetune"], tuned_dir, 1e-2, tokenizer_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "successfully loaded checkpoint" in result.stdout and "iteration        2/       2" in result.stdout
    tuned_hf = str(root / "tuned_hf")
    result = convert("--loader", "core", "--saver", "hf", "--load-dir", tuned_dir, "--save-dir", tuned_hf)
    assert result.returncode == 0, result.stderr
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tuned_hf))
    with open(os.path.join(tuned_hf, "config.json")) as file:
        assert json.load(file)["architectures"] == ["Qwen2ForCausalLM"]  # inferred: RoPE, SwiGLU, QKV bias
    source, tuned = _load(hf_dir), _load(tuned_hf)
    assert sorted(tuned) == sorted(source) and tuned["model.embed_tokens.weight"].shape[0] == 350  # padding gone
    assert not torch.equal(tuned["model.layers.0.mlp.up_proj.weight"], source["model.layers.0.mlp.up_proj.weight"])

    # The exported fine-tuned model is the fine-tuned Megatron model: same logits.
    input_ids = torch.randint(0, 350, (2, 12), generator=torch.Generator().manual_seed(3))
    model = transformers.AutoModelForCausalLM.from_pretrained(tuned_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids).logits
    actual = run_distributed(1, _megatron_logits, tuned_dir, input_ids)[0][..., :350]
    assert ((actual - expected).norm() / expected.norm()).item() <= 1e-5


def test_hybrid_convert_finetune_and_export(tmp_path):
    """NemotronH: --model-type hybrid to a Megatron checkpoint (args TP 2), pretrain_hybrid.py fine-tunes it at TP2
    with --use-checkpoint-args, and the result exports to an HF NemotronH whose logits are the Megatron model's."""
    import transformers
    from tokenizers import Tokenizer

    from tests.unit_tests.test_utilities import run_distributed

    hf_dir = write_huggingface_dir(tmp_path / "hf")
    vocab = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json")).get_vocab_size()
    save_hf_model("nemotron_h", hf_dir, vocab_size=vocab)
    megatron_dir = str(tmp_path / "megatron")
    result = convert(
        "--loader",
        "hf",
        "--saver",
        "core",
        "--load-dir",
        hf_dir,
        "--save-dir",
        megatron_dir,
        "--target-tensor-parallel-size",
        "2",
        model_type="hybrid",
    )
    assert result.returncode == 0, result.stderr
    tuned_dir = str(tmp_path / "tuned")
    result = finetune(
        ["--load", megatron_dir, "--finetune"],
        tuned_dir,
        1e-2,
        os.path.join(megatron_dir, "hf_tokenizer"),
        nproc=2,
        entry_point=REPO_ROOT / "pretrain_hybrid.py",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "successfully loaded checkpoint" in result.stdout and "iteration        2/       2" in result.stdout
    tuned_hf = str(tmp_path / "tuned_hf")
    result = convert(
        "--loader", "core", "--saver", "hf", "--load-dir", tuned_dir, "--save-dir", tuned_hf, model_type="hybrid"
    )
    assert result.returncode == 0, result.stderr
    with open(os.path.join(tuned_hf, "config.json")) as file:
        config = json.load(file)
    assert config["architectures"] == ["NemotronHForCausalLM"]  # inferred from the hybrid's args
    assert config["layers_block_type"] == ["linear_attention", "full_attention", "mlp", "linear_attention"]
    source, tuned = _load(hf_dir), _load(tuned_hf)
    assert sorted(tuned) == sorted(source) and tuned["backbone.embeddings.weight"].shape[0] == vocab
    name = "backbone.layers.0.mixer.in_proj.weight"
    assert not torch.equal(tuned[name], source[name])
    input_ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    model = transformers.AutoModelForCausalLM.from_pretrained(tuned_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids).logits
    actual = run_distributed(1, _megatron_logits, tuned_dir, input_ids)[0][..., :vocab]
    assert ((actual - expected).norm() / expected.norm()).item() <= 1e-5
    # --model-type GPT for the hybrid checkpoint is refused before anything is written
    result = convert(
        "--loader", "core", "--saver", "hf", "--load-dir", tuned_dir, "--save-dir", str(tmp_path / "wrong")
    )
    assert result.returncode == 1 and "which converts as --model-type hybrid" in result.stderr
    assert not (tmp_path / "wrong").exists()


def test_use_checkpoint_args_reads_the_pretrained_checkpoint(hf_source, tmp_path):
    """--use-checkpoint-args with --pretrained-checkpoint (and nothing in --load yet) takes the model flags from the
    pretrained checkpoint, as load_checkpoint will load it."""
    import argparse

    from megatron.training.checkpointing import load_args_from_checkpoint

    root, _ = hf_source
    megatron_dir = str(root / "megatron")  # written by the test above, or now
    if not os.path.isdir(megatron_dir):
        assert (
            convert(
                "--loader", "hf", "--saver", "core", "--load-dir", hf_source[1], "--save-dir", megatron_dir
            ).returncode
            == 0
        )
    args = argparse.Namespace(
        load=str(tmp_path / "empty"),
        pretrained_checkpoint=megatron_dir,
        ckpt_step=None,
        num_layers=None,
        hidden_size=None,
        add_qkv_bias=False,
    )
    load_args_from_checkpoint(args)
    assert (args.num_layers, args.hidden_size, args.add_qkv_bias, args.swiglu) == (2, 32, True, True)


@pytest.mark.parametrize(
    "arguments, match",
    [
        (["--loader", "core", "--saver", "core"], "--loader core --saver core: supported are --loader hf --saver core"),
        (["--loader", "hf", "--saver", "hf"], "--loader hf --saver hf: supported are"),
        (
            ["--loader", "hf", "--saver", "core", "--model-type", "BERT"],
            "--model-type BERT: only GPT and hybrid models",
        ),
        (
            ["--loader", "hf", "--saver", "core", "--model-type", "hybrid"],
            "holds a qwen2 model (Qwen2ForCausalLM), which converts as --model-type GPT",
        ),
    ],
)
def test_cli_refuses_unsupported_pairs_and_model_types(hf_source, tmp_path, capsys, arguments, match):
    from megatron.training.error_handling import run_tool
    from tools.checkpoint.convert import main

    _, hf_dir = hf_source
    argv = ["--model-type", "GPT", *arguments, "--load-dir", hf_dir, "--save-dir", str(tmp_path / "out")]
    assert run_tool(main, argv) == 1
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_missing_and_identical_dirs(tmp_path, capsys):
    from megatron.training.error_handling import run_tool
    from tools.checkpoint.convert import main

    common = ["--model-type", "GPT", "--loader", "hf", "--saver", "core"]
    assert run_tool(main, [*common, "--load-dir", str(tmp_path / "nowhere"), "--save-dir", str(tmp_path / "out")]) == 1
    assert "nowhere: no such directory (only local directories are read)" in capsys.readouterr().err
    assert run_tool(main, [*common, "--load-dir", str(tmp_path), "--save-dir", str(tmp_path)]) == 1
    assert "is --load-dir; write the conversion somewhere else" in capsys.readouterr().err


def test_mixtral_convert_finetune_at_tp2_ep2_and_export(tmp_path):
    """Mixtral through the command line: HF -> Megatron (MoE flags in args) -> HF gives back every tensor bit for bit;
    pretrain_gpt.py fine-tunes the converted checkpoint at TP2 x EP2 (--use-checkpoint-args supplies --num-experts
    and the router flags), and the fine-tuned model exported to HF gives the Megatron model's logits."""
    import transformers
    from tokenizers import Tokenizer

    from tests.unit_tests.test_utilities import run_distributed

    hf_dir = write_huggingface_dir(tmp_path / "hf")
    vocab = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json")).get_vocab_size()
    save_hf_model("mixtral", hf_dir, vocab_size=vocab)
    megatron_dir, back_dir = str(tmp_path / "megatron"), str(tmp_path / "back")
    result = convert(
        "--loader",
        "hf",
        "--saver",
        "core",
        "--load-dir",
        hf_dir,
        "--save-dir",
        megatron_dir,
        "--target-tensor-parallel-size",
        "2",
    )
    assert result.returncode == 0, result.stderr
    result = convert("--loader", "core", "--saver", "hf", "--load-dir", megatron_dir, "--save-dir", back_dir)
    assert result.returncode == 0, result.stderr
    source, back = _load(hf_dir), _load(back_dir)
    assert sorted(back) == sorted(source) and all(torch.equal(back[name], source[name]) for name in source)

    tuned_dir, tuned_hf = str(tmp_path / "tuned"), str(tmp_path / "tuned_hf")
    tokenizer_dir = os.path.join(megatron_dir, "hf_tokenizer")
    result = finetune(
        ["--load", megatron_dir, "--finetune", "--expert-model-parallel-size", "2", "--sequence-parallel"],
        tuned_dir,
        1e-2,
        tokenizer_dir,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "successfully loaded checkpoint" in result.stdout and "iteration        2/       2" in result.stdout
    result = convert("--loader", "core", "--saver", "hf", "--load-dir", tuned_dir, "--save-dir", tuned_hf)
    assert result.returncode == 0, result.stderr
    with open(os.path.join(tuned_hf, "config.json")) as file:
        config = json.load(file)
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    tuned = _load(tuned_hf)
    assert sorted(tuned) == sorted(source)
    expert = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert not torch.equal(tuned[expert], source[expert])

    input_ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    model = transformers.AutoModelForCausalLM.from_pretrained(tuned_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids).logits
    actual = run_distributed(1, _megatron_logits, tuned_dir, input_ids)[0][..., :vocab]
    assert ((actual - expected).norm() / expected.norm()).item() <= 1e-5
