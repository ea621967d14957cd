"""Every Megatron-LM 0.19 flag against the reference table (megatron_0.19_flags.txt: options | dest | action |
default | type | choices | nargs, dumped from Megatron-LM's own parser); what each flag for a missing feature does
(refused, or ignored with one warning); the flags that work; Megatron-LM's launch scripts; unknown-flag messages."""

import argparse
import dataclasses
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import openai_gelu
from megatron.core.utils import warn_once
from megatron.training.argument_utils import (
    core_ddp_config_from_args,
    core_optimizer_config_from_args,
    core_transformer_config_from_args,
)
from megatron.training.arguments import (
    FLAG_TABLES,
    build_parser,
    moe_freq_type,
    parse_args_list,
    tuple_type,
    validate_args,
)
from tests.unit_tests.training.test_arguments import BASE, BUILTIN_PREFIX, validated, without

REPO_ROOT = Path(__file__).resolve().parents[3]
REFERENCE = Path(__file__).with_name("megatron_0.19_flags.txt")
# Where this project's flag differs from Megatron-LM's on purpose: Transformer Engine is optional here.
DIFFERENT_ON_PURPOSE = {"--transformer-impl": {"default": "'local'"}}
ACTION_NAMES = {
    argparse._StoreAction: "Store",
    argparse._StoreTrueAction: "StoreTrue",
    argparse._StoreFalseAction: "StoreFalse",
    argparse.BooleanOptionalAction: "BooleanOptional",
}


def _reference_rows():
    rows = []
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        options, dest, action, default, kind, choices, nargs = [field.strip() for field in line.split(" | ")]
        rows.append(
            dict(options=options, dest=dest, action=action, default=default, type=kind, choices=choices, nargs=nargs)
        )
    return rows


ROWS = _reference_rows()
ACTIONS = {option: action for action in build_parser()._actions for option in action.option_strings}


def _described(action, megatron_row):
    """One of our actions in the reference table's terms."""
    described = dict(
        options=", ".join(action.option_strings),
        dest=action.dest,
        action=ACTION_NAMES[type(action)],
        default=repr(action.default),
        type=getattr(action.type, "__name__", "") if action.type else "",
        choices=repr(list(action.choices)) if action.choices is not None else "",
        nargs="" if action.nargs in (None, 0) else str(action.nargs),
    )
    if described["action"] == "BooleanOptional":
        described["type"] = megatron_row["type"]  # BooleanOptionalAction takes no value, so its type is never used
    return described


def test_the_reference_table_is_complete():
    assert len(ROWS) == 807


@pytest.mark.parametrize("row", ROWS, ids=[row["options"].split(",")[0] for row in ROWS])
def test_flag_is_megatron_lms(row):
    first = row["options"].split(",")[0]
    assert first in ACTIONS, f"{first} is not accepted"
    expected = dict(row, **DIFFERENT_ON_PURPOSE.get(first, {}))
    assert _described(ACTIONS[first], row) == expected


# ---- flags for what this project does not do ----------------------------------------------------------------------


def _first_rows_by_dest(kind):
    """``(feature or what it tunes, flag)`` of every table row of ``kind`` that owns its dest's default."""
    seen, rows = set(), []
    for table in FLAG_TABLES:
        for flag in table.flags:
            if flag.dest in seen:
                continue
            seen.add(flag.dest)
            text = table.not_supported if kind == "not_supported" else table.no_effect
            if text is not None:
                rows.append((text, flag))
    return rows


def _non_default_argv(flag):
    """Command-line words that set ``flag`` to something other than its default."""
    option, kwargs = flag.options[0], flag.kwargs
    if kwargs.get("action") in ("store_true", "store_false", argparse.BooleanOptionalAction):
        return [option]
    default, kind = kwargs.get("default"), kwargs.get("type")
    defaults = default if isinstance(default, list) else [default]
    if kwargs.get("choices"):
        return [option, str(next(choice for choice in kwargs["choices"] if choice not in defaults))]
    examples = {
        int: "3",
        float: "0.25",
        bool: "True",
        "tuple_type": "(128, 0)",
        "moe_freq_type": "3",
        "la_freq_type": "3",
        "no_rope_freq_type": "3",
        "_parse_cuda_graph_modules_arg": "attn",
    }
    value = examples.get(kind, "something")
    if kind in (int, float) and default is not None and not isinstance(default, list):
        value = str(default + 1)
    return [option, value]


NOT_SUPPORTED = _first_rows_by_dest("not_supported")
NO_EFFECT = _first_rows_by_dest("no_effect")


@pytest.mark.parametrize("feature, flag", NOT_SUPPORTED, ids=[flag.options[0] for _, flag in NOT_SUPPORTED])
def test_flag_for_a_feature_not_built_yet_is_refused_when_set(feature, flag, capsys):
    assert validated()  # at its default the flag changes nothing
    argv = _non_default_argv(flag)
    with pytest.raises(ValueError, match=rf"not supported yet: {re.escape(feature)} \({re.escape(flag.options[0])}"):
        validated(*argv)


@pytest.mark.parametrize("reason, flag", NO_EFFECT, ids=[flag.options[0] for _, flag in NO_EFFECT])
def test_flag_without_effect_warns_once_and_is_ignored(reason, flag, capsys):
    warn_once.cache_clear()
    argv = _non_default_argv(flag)
    with pytest.warns(UserWarning) as record:
        args = validated(*argv)
        validated(*argv)
    messages = [str(warning.message) for warning in record if "has no effect here" in str(warning.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{flag.options[0]}") and f"has no effect here ({reason}); ignoring it" in messages[0]
    assert getattr(args, flag.dest) == flag.default


def test_flags_without_effect_warn_only_on_rank_0(capsys):
    warn_once.cache_clear()
    args = parse_args_list(BASE + ["--fp8-interval", "2", "--profile"])
    args.rank = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_args(args)
    assert args.fp8_interval == 1 and args.profile is False


def test_every_refused_setting_is_named_in_one_error():
    with pytest.raises(ValueError) as raised:
        validated("--moe-use-upcycling", "--multi-latent-attention", "--hybrid-context-parallel", world_size=2)
    assert str(raised.value) == (
        "not supported yet: these mixture-of-experts options (--moe-use-upcycling); multi-latent attention (MLA) "
        "and YaRN rotary scaling (--multi-latent-attention); hybrid context parallelism (--hybrid-context-parallel). "
        "Remove the flag(s) or use the default."
    )


@pytest.mark.parametrize(
    "argv, feature",
    [
        (["--position-embedding-type", "yarn"], "YaRN rotary embeddings"),
        (["--optimizer", "soap"], "the soap optimizer"),
        (["--tokenizer-type", "BertWordPieceCase"], "the BertWordPieceCase"),
        (["--transformer-impl", "inference_optimized"], "inference-optimized layers"),
        (["--rope-type", "yarn"], "multi-latent attention (MLA) and YaRN rotary scaling"),
    ],
)
def test_choices_not_built_yet_are_refused(argv, feature):
    with pytest.raises(ValueError, match=rf"not supported yet: {re.escape(feature)} \({re.escape(' '.join(argv))}\)"):
        validated(*argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "4"], "--batch-size is no longer valid; use --micro-batch-size"),
        (["--warmup", "10"], "--warmup is no longer valid; use --lr-warmup-fraction"),
        (["--model-parallel-size", "2"], "--model-parallel-size is no longer valid; use --tensor-model-parallel-size"),
        (["--checkpoint-activations"], "--checkpoint-activations is no longer valid; use --recompute-activations"),
    ],
)
def test_deprecated_flags_name_their_replacement(argv, message):
    with pytest.raises(ValueError, match=message):
        validated(*argv)


# ---- flags that work ----------------------------------------------------------------------------------------------


def test_encoder_seq_length_and_encoder_num_layers_are_other_names():
    args = validated(
        "--encoder-seq-length",
        16,
        "--encoder-num-layers",
        2,
        base=without("--num-layers", base=without("--seq-length")),
    )
    assert (args.seq_length, args.encoder_seq_length, args.num_layers, args.encoder_num_layers) == (16, 16, 2, 2)
    assert validated("--encoder-seq-length", 32).seq_length == 32
    with pytest.raises(ValueError, match=r"--seq-length \(32\) and --encoder-seq-length \(16\) are two names"):
        validated("--encoder-seq-length", 16)


def test_deprecated_position_embedding_flags():
    assert validated("--use-rotary-position-embeddings").position_embedding_type == "rope"
    assert validated("--no-position-embedding", "--position-embedding-type", "rope").add_position_embedding is False
    with pytest.raises(ValueError, match="--no-position-embedding is deprecated: use --position-embedding-type"):
        validated("--no-position-embedding")


def test_rope_type_rope_is_the_rotary_embedding_that_runs():
    # Megatron-LM's launch scripts (examples/gptoss) spell out the default rotary type of attention without MLA.
    args = validated("--position-embedding-type", "rope", "--rope-type", "rope")
    assert args.rope_type == "rope" and args.position_embedding_type == "rope"
    assert not hasattr(core_transformer_config_from_args(args), "rope_type")  # MLA-only config field


def test_openai_gelu_and_no_initialization_reach_the_config():
    config = core_transformer_config_from_args(validated("--openai-gelu", "--no-initialization"))
    assert config.activation_func is openai_gelu
    assert config.perform_initialization is False


def test_step_batch_size_schedule_and_log_progress_are_kept_for_the_run():
    args = validated("--step-batch-size-schedule", "0:2 1K:4", "--log-progress")
    assert (args.step_batch_size_schedule, args.log_progress) == ("0:2 1K:4", True)
    with pytest.raises(ValueError, match="--rampup-batch-size and --step-batch-size-schedule both schedule"):
        validated(
            "--step-batch-size-schedule",
            "0:2",
            "--rampup-batch-size",
            2,
            2,
            100,
            "--train-samples",
            1000,
            base=without("--train-iters"),
        )


def test_config_builders_take_megatron_lms_flag_values():
    args = validated("--apply-wd-to-qk-layernorm")
    optimizer = core_optimizer_config_from_args(args)
    assert optimizer.apply_wd_to_qk_layernorm is True
    # Megatron-LM's dtype flags hold names; the config holds torch dtypes.
    assert (optimizer.main_grads_dtype, optimizer.exp_avg_dtype) == (torch.float32, torch.float32)
    # --data-parallel-sharding-strategy defaults to FSDP's strategy, which plain DDP does not read.
    assert args.data_parallel_sharding_strategy == "optim_grads_params"
    assert core_ddp_config_from_args(args).data_parallel_sharding_strategy == "no_shard"


def test_every_transformer_config_field_comes_from_the_argument_of_its_name():
    args = validated("--hidden-dropout", 0.2, "--init-method-std", 0.01, "--qk-layernorm")
    config = core_transformer_config_from_args(args)
    # Derived when the config is built: GQA only with --group-query-attention; these two from other fields; a
    # one-element --cp-comm-type list becomes the one string for every layer (as Megatron-LM passes it).
    derived = {"num_query_groups", "microbatch_group_size_per_vp_stage", "embedding_init_method_std", "cp_comm_type"}
    copied = [field.name for field in dataclasses.fields(TransformerConfig) if hasattr(args, field.name)]
    assert len(copied) > 200
    assert {
        name: (getattr(config, name), getattr(args, name))
        for name in copied
        if name not in derived and getattr(config, name) != getattr(args, name)
    } == {}
    assert (config.hidden_dropout, config.init_method_std, config.qk_layernorm) == (0.2, 0.01, True)
    assert (args.cp_comm_type, config.cp_comm_type) == (["p2p"], "p2p")


def test_exit_signal_by_name():
    assert parse_args_list(["--exit-signal", "SIGUSR1"]).exit_signal is signal.SIGUSR1
    assert parse_args_list([]).exit_signal is signal.SIGTERM


def test_layer_pattern_types():
    assert moe_freq_type("2") == 2
    assert moe_freq_type("([1]*3+[0])*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    with pytest.raises(argparse.ArgumentTypeError, match="not a layer frequency pattern"):
        moe_freq_type("__import__('os').getcwd()")  # evaluated without eval: no call runs
    assert tuple_type("(128, 0)") == (128, 0)
    assert parse_args_list(["--moe-layer-freq", "[0]+[1]*3"]).moe_layer_freq == [0, 1, 1, 1]


# ---- Megatron-LM's launch scripts ---------------------------------------------------------------------------------

# The Megatron-LM flags of examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh,
# examples/mixtral/train_mixtral_8x7b_distributed.sh and examples/mamba/train.sh (800M), with this machine's paths.
# The Mamba script's --hybrid-attention-ratio/--hybrid-mlp-ratio are not 0.19 flags (Megatron-LM 0.19 rejects them;
# here they are accepted, deprecated); --is-hybrid-model stands for them (an all-Mamba model). The GPT-3 script ramps
# the batch size up with --train-iters, which
# Megatron-LM's validate_args refuses as well ("expected no batch-size rampup for iteration-based training").
GPT3_175B = (
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
    "--attention-backend auto --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 "
    "--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 "
    "--clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 "
    "--lr-decay-iters 430000 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 "
    "--data-path {data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1 --log-interval 100 "
    "--save-interval 10000 --eval-interval 1000 --save {ckpt} --load {ckpt} --eval-iters 10 --tensorboard-dir {tb}"
)
LLAMA3_8B_FP8 = (
    "--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 "
    "--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused "
    "--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
    "--global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 "
    "--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine "
    "--clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 "
    "--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 "
    "--exit-duration-in-mins 235 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather "
    "--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {cache} --tiktoken-pattern v2 "
    "--split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --log-interval 1 "
    "--eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile --profile-step-start 4 "
    "--profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60 --save {ckpt} --load {ckpt} "
    "--tensorboard-dir {tb}"
)
MIXTRAL_8X7B = (
    "--use-mcore-models --disable-bias-linear --seq-length 256 --max-position-embeddings 2048 --num-layers 2 "
    "--hidden-size 256 --ffn-hidden-size 896 --num-attention-heads 2 --init-method-std 0.01 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion "
    "--no-position-embedding --rotary-base 1000000 --num-experts 2 --moe-router-topk 2 "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall "
    "--overlap-param-gather --overlap-grad-reduce --tokenizer-type Llama2Tokenizer --tokenizer-model {tokenizer} "
    "--mock-data --split 99990,8,2 --micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 7 "
    "--min-lr 1.0e-5 --weight-decay 0.1 --clip-grad 1.0 --tensor-model-parallel-size 1 "
    "--pipeline-model-parallel-size 1 --expert-model-parallel-size 2 --use-distributed-optimizer "
    "--sequence-parallel --eval-iters 10 --no-load-optim --no-load-rng"
)
MAMBA_800M = (
    "--tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 1 "
    "--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce --untie-embeddings-and-output-weights "
    "--init-method-std 0.02 --position-embedding-type none --num-layers 48 --hidden-size 1024 "
    "--num-attention-heads 16 --group-query-attention --num-query-groups 8 --is-hybrid-model --seq-length 4096 "
    "--max-position-embeddings 4096 --train-samples 73242188 --lr-warmup-samples 50000 "
    "--lr-decay-samples 73192188 --save {ckpt} --load {ckpt} --data-path {data} --data-cache-path {cache} "
    "--split 99,1,0 --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {tokenizer} "
    "--distributed-backend nccl --micro-batch-size 4 --global-batch-size 32 --lr 2.5e-4 --min-lr 2.5e-5 "
    "--lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--disable-bias-linear --normalization RMSNorm --adam-beta1 0.9 --adam-beta2 0.95 --log-interval 10 "
    "--save-interval 2000 --eval-interval 2000 --eval-iters 32 --bf16 --use-mcore-models "
    "--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec --no-create-attention-mask-in-dataloader "
    "--tensorboard-dir {tb}"
)


@pytest.mark.parametrize(
    "flags, world_size, outcome",
    [
        (GPT3_175B, 128, "--rampup-batch-size counts samples, but --train-iters counts iterations"),
        (LLAMA3_8B_FP8, 8, None),
        (MIXTRAL_8X7B, 2, None),
        (MAMBA_800M, 8, None),
    ],
    ids=["gpt3-175b", "llama3-8b-fp8", "mixtral-8x7b", "mamba-800m"],
)
def test_megatron_launch_scripts_get_past_parsing(flags, world_size, outcome, tmp_path, monkeypatch, capsys):
    from megatron.training import builtin_data

    paths = dict(
        data=BUILTIN_PREFIX,
        vocab=builtin_data.vocab_file(),
        merges=builtin_data.merge_file(),
        ckpt=tmp_path / "ckpt",
        tb=tmp_path / "tb",
        cache=tmp_path / "cache",
        tokenizer=tmp_path / "tok",
    )
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = parse_args_list(flags.format(**paths).split())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nccl -> gloo, fused kernels, fp8 and profiler knobs
        if outcome is None:
            validate_args(args)
        else:
            with pytest.raises(ValueError, match=re.escape(outcome)):
                validate_args(args)


# ---- unknown flags ------------------------------------------------------------------------------------------------


def test_misspelled_flag_gets_one_line_with_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as raised:
        parse_args_list(BASE + ["--tensor-model-paralel-size", "2"])
    assert raised.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == "unknown flag --tensor-model-paralel-size; did you mean --tensor-model-parallel-size?\n"


def test_only_rank_0_prints_a_parse_error(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as raised:
        parse_args_list(["--tensor-model-paralel-size", "2"])
    assert raised.value.code == 2
    assert capsys.readouterr().err == ""


def test_several_unknown_flags_get_a_line_each(capsys):
    with pytest.raises(SystemExit) as raised:
        parse_args_list(["--num-layer", "2", "--hiden-size=64", "--zzz"])
    assert raised.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "unknown flag --num-layer; did you mean --num-layers?",
        "unknown flag --hiden-size; did you mean --hidden-size?",
        "unknown flag --zzz",
    ]


def test_other_parse_errors_are_one_line_without_the_usage(capsys):
    with pytest.raises(SystemExit) as raised:
        parse_args_list(["--attention-backend", "cudnn"])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "usage" not in error and "--attention-backend" in error


def test_misspelled_flag_on_the_entry_point_prints_under_5_lines():
    ran = subprocess.run(
        [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), "--tensor-model-paralel-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    output = (ran.stdout + ran.stderr).strip().splitlines()
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert len(output) < 5, output
    assert "unknown flag --tensor-model-paralel-size; did you mean --tensor-model-parallel-size?" in output
