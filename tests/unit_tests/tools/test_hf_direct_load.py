"""pretrain_gpt.py --load HF_DIR: training starts from a Hugging Face directory without a conversion. The first
iteration's loss equals that of the same run started from the converted checkpoint (the weights loaded, every TP
shard); --save then writes a Megatron checkpoint; a run whose model flags are not the HF model's is refused."""

import argparse
import os
import re

import pytest

from tests.unit_tests.models.huggingface.hf_test_models import save_hf_model
from tests.unit_tests.tools.test_checkpoint_convert import convert, finetune, hf_source  # noqa: F401 (fixture)


def _first_loss(stdout: str) -> str:
    match = re.search(r"iteration +1/ +2 \|.* lm loss: ([0-9.E+-]+) \|", stdout)
    assert match is not None, stdout[-3000:]
    return match.group(1)


def test_finetune_directly_from_a_hugging_face_directory(hf_source, tmp_path):  # noqa: F811
    _, hf_dir = hf_source
    layout = ["--tensor-model-parallel-size", "2"]
    direct = finetune(["--load", hf_dir, "--finetune", *layout], str(tmp_path / "direct"), 1e-2, hf_dir, nproc=2)
    assert direct.returncode == 0, direct.stdout[-3000:] + direct.stderr[-3000:]
    assert direct.stdout.count("loading the Hugging Face model") == 1  # said once, by rank 0
    assert "fresh optimizer" in direct.stdout and "iteration        2/       2" in direct.stdout
    with open(tmp_path / "direct" / "latest_checkpointed_iteration.txt") as file:
        assert file.read().strip() == "2"  # an ordinary Megatron checkpoint to resume from

    megatron_dir = str(tmp_path / "converted")
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
    converted = finetune(
        ["--load", megatron_dir, "--finetune", *layout], str(tmp_path / "tuned"), 1e-2, hf_dir, nproc=2
    )
    assert converted.returncode == 0, converted.stdout[-3000:] + converted.stderr[-3000:]
    assert _first_loss(direct.stdout) == _first_loss(converted.stdout)


def test_pretrain_hybrid_directly_from_a_nemotron_h_directory(tmp_path):
    """NemotronH with pretrain_hybrid.py --load HF_DIR at TP2, learning rate 0: the checkpoint it saves exports
    back to the source's tensors bit for bit (every shard was loaded; the TP2 split of the loader is checked
    against HF's logits in tests/unit_tests/models/huggingface/test_hf_nemotron_h.py)."""
    import torch
    from tokenizers import Tokenizer

    from tests.unit_tests.tokenizers.tiny_tokenizer_files import write_huggingface_dir
    from tests.unit_tests.tools.test_checkpoint_convert import REPO_ROOT, _load

    hf_dir = write_huggingface_dir(tmp_path / "hf")
    save_hf_model(
        "nemotron_h", hf_dir, vocab_size=Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json")).get_vocab_size()
    )
    direct = finetune(
        ["--load", hf_dir, "--tensor-model-parallel-size", "2"],
        str(tmp_path / "direct"),
        0.0,
        hf_dir,
        nproc=2,
        entry_point=REPO_ROOT / "pretrain_hybrid.py",
    )
    assert direct.returncode == 0, direct.stdout[-3000:] + direct.stderr[-3000:]
    assert "loading the Hugging Face model" in direct.stdout  # fine-tuning semantics without --finetune too
    exported = str(tmp_path / "exported")
    result = convert(
        "--loader",
        "core",
        "--saver",
        "hf",
        "--load-dir",
        str(tmp_path / "direct"),
        "--save-dir",
        exported,
        model_type="hybrid",
    )
    assert result.returncode == 0, result.stderr
    source, back = _load(hf_dir), _load(exported)
    assert sorted(back) == sorted(source)
    assert all(torch.equal(back[name], source[name]) for name in source)


def _run_args(hf_dir, **changes):
    """This run's arguments as the command line would give them for the HF model, with ``changes``."""
    from megatron.training.hf_checkpoint import hf_checkpoint_args

    args = hf_checkpoint_args(argparse.Namespace(tensor_model_parallel_size=2), hf_dir)
    args.is_hybrid_model = False
    return argparse.Namespace(**{**vars(args), **changes})


def test_model_flags_must_match_the_hugging_face_config(hf_source):  # noqa: F811
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.training.hf_checkpoint import check_args_match_hf

    _, hf_dir = hf_source
    check_args_match_hf(_run_args(hf_dir), hf_dir)  # the same model: accepted
    with pytest.raises(
        CheckpointingException,
        match=re.escape(
            f"--load {hf_dir}: this run's model is not the Hugging Face model: --hidden-size is 64, the HF config "
            "gives 32; --add-qkv-bias is False, the HF config gives True (pass --use-checkpoint-args"
        ),
    ):
        check_args_match_hf(_run_args(hf_dir, hidden_size=64, add_qkv_bias=False), hf_dir)
    # without --group-query-attention every head is its own group: 4 groups, not the HF model's 2
    with pytest.raises(CheckpointingException, match="--num-query-groups is 4, the HF config gives 2"):
        check_args_match_hf(_run_args(hf_dir, group_query_attention=False), hf_dir)


def test_a_hybrid_hugging_face_model_needs_pretrain_hybrid(tmp_path):
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.training.hf_checkpoint import check_args_match_hf

    hf_dir = save_hf_model("nemotron_h", str(tmp_path / "nh"))
    with pytest.raises(CheckpointingException, match="--is-hybrid-model is False, the HF config gives True"):
        check_args_match_hf(_run_args(hf_dir), hf_dir)


@pytest.mark.parametrize("flag", ["load", "pretrained_checkpoint"])
def test_use_checkpoint_args_reads_the_hugging_face_config(hf_source, tmp_path, flag):  # noqa: F811
    """--use-checkpoint-args with --load HF_DIR, or --pretrained-checkpoint HF_DIR and an empty --load: the model
    flags and the tokenizer from the HF directory, the layout from the command line."""
    from megatron.training.checkpointing import load_args_from_checkpoint

    _, hf_dir = hf_source
    paths = {"load": str(tmp_path / "empty"), "pretrained_checkpoint": None, flag: hf_dir}
    args = argparse.Namespace(
        **paths,
        ckpt_step=None,
        num_layers=None,
        hidden_size=None,
        add_qkv_bias=False,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        make_vocab_size_divisible_by=128,
        use_mp_args_from_checkpoint_args=True,
        tokenizer_model=None,
    )
    load_args_from_checkpoint(args)
    assert (args.num_layers, args.hidden_size, args.add_qkv_bias, args.swiglu) == (2, 32, True, True)
    assert (args.tensor_model_parallel_size, args.tokenizer_type) == (2, "HuggingFaceTokenizer")
    assert args.tokenizer_model == os.path.abspath(hf_dir)


def test_a_directory_without_weights_is_no_hugging_face_model(tmp_path):
    from megatron.training.hf_checkpoint import is_hugging_face_directory

    (tmp_path / "config.json").write_text("{}")
    assert not is_hugging_face_directory(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert is_hugging_face_directory(str(tmp_path))


def test_pretrain_gpt_refuses_model_flags_other_than_the_hugging_face_model(hf_source):  # noqa: F811
    """Without --use-checkpoint-args, a run whose flags build another model stops with the differences."""
    from tests.functional_tests.harness import CPU_FLAGS, torchrun_command
    from tests.unit_tests.tools.test_checkpoint_convert import run

    _, hf_dir = hf_source
    flags = [
        "--load",
        hf_dir,
        "--finetune",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "64",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        hf_dir,
        "--mock-data",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-iters",
        "1",
        "--lr",
        "1e-3",
        "--eval-iters",
        "0",
        *CPU_FLAGS,
    ]
    result = run(torchrun_command(flags, nproc=1), timeout=300)
    assert result.returncode != 0
    assert (
        f"--load {hf_dir}: this run's model is not the Hugging Face model: --hidden-size is 64, the HF config gives 32;"
    ) in result.stdout + result.stderr
    assert "iteration        1/" not in result.stdout


def test_a_hybrid_hugging_face_model_is_not_loaded_into_a_gpt_model(tmp_path):
    """pretrain_gpt.py --use-checkpoint-args on a NemotronH directory (its flags then match): the built model is
    not a HybridModel, which is refused naming pretrain_hybrid.py."""
    import torch

    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.training.global_vars import set_args, unset_global_variables
    from megatron.training.hf_checkpoint import load_hf_checkpoint

    hf_dir = save_hf_model("nemotron_h", str(tmp_path / "nh"))
    args = _run_args(hf_dir, is_hybrid_model=True, fp16=False, bf16=False)
    set_args(args)
    try:
        with pytest.raises(
            CheckpointingException,
            match=f"--load {hf_dir}: a hybrid model, this run built Linear; train it with pretrain_hybrid.py",
        ):
            load_hf_checkpoint([torch.nn.Linear(1, 1)], None, hf_dir)
    finally:
        unset_global_variables()
