"""parse_args / validate_args: the golden flag list, Megatron-LM's defaults and dest names, derived values, every
validation error, the machine fallbacks, and the config builders."""

import json
import os
import re
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Callable, List, Optional

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import squared_relu
from megatron.core.tokenizers import NullTokenizer
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import warn_once
from megatron.training import argument_validation
from megatron.training.argument_utils import add_field_argument, config_field_docs
from megatron.training.flag_tables import flag_for
from megatron.training.arguments import (
    build_parser,
    core_ddp_config_from_args,
    core_gpt_dataset_config_from_args,
    core_optimizer_config_from_args,
    core_transformer_config_from_args,
    get_blend_and_blend_per_split,
    parse_args_list,
    validate_args,
)

GOLDEN_FLAGS = os.path.join(os.path.dirname(__file__), "golden_help_flags.txt")
BUILTIN_PREFIX = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "megatron", "training", "builtin_data", "shakespeare_text_document"
)
# Every switch that would otherwise be turned off on this machine, so most tests run without the fallback warning.
QUIET = [
    "--distributed-backend",
    "gloo",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-rope-fusion",
]
BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "100",
] + QUIET


def parse(*extra, base=BASE):
    return parse_args_list(list(base) + [str(item) for item in extra])


def validated(*extra, world_size=1, base=BASE, defaults=None):
    args = parse(*extra, base=base)
    args.world_size = world_size
    return validate_args(args, defaults or {})


def without(flag, base=BASE, takes_value=True):
    index = base.index(flag)
    return base[:index] + base[index + 1 + int(takes_value) :]


# ---- the flag list and Megatron-LM's defaults ---------------------------------------------------------------------


def test_help_flag_list_matches_the_golden_file():
    flags = sorted(option for action in build_parser()._actions for option in action.option_strings)
    with open(GOLDEN_FLAGS) as stream:
        golden = stream.read().split()
    added, removed = sorted(set(flags) - set(golden)), sorted(set(golden) - set(flags))
    assert flags == golden, (
        f"--help flags changed (added {added}, removed {removed}); if intended, update {GOLDEN_FLAGS}"
    )


MEGATRON_DEFAULTS = {
    # parallelism
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "sequence_parallel": False,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "num_virtual_stages_per_pipeline_rank": None,
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    "use_distributed_optimizer": False,
    "overlap_grad_reduce": False,
    "overlap_param_gather": False,
    "overlap_p2p_comm": True,
    "align_param_gather": True,
    "align_grad_reduce": True,
    "ddp_bucket_size": None,
    "num_distributed_optimizer_instances": 1,
    "data_parallel_sharding_strategy": "optim_grads_params",
    "distributed_backend": "nccl",
    "distributed_timeout_minutes": 10,
    # model shape / architecture
    "num_layers": None,
    "hidden_size": None,
    "ffn_hidden_size": None,
    "num_attention_heads": None,
    "group_query_attention": False,
    "num_query_groups": 1,
    "kv_channels": None,
    "seq_length": None,
    "max_position_embeddings": None,
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "normalization": "LayerNorm",
    "layernorm_epsilon": 1e-5,
    "layernorm_zero_centered_gamma": False,
    "swiglu": False,
    "squared_relu": False,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "untie_embeddings_and_output_weights": False,
    "make_vocab_size_divisible_by": 128,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "init_method_std": 0.02,
    "attention_backend": AttnBackend.auto,
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
    "recompute_activations": False,
    "num_experts": None,
    # mixed precision and fused kernels
    "bf16": False,
    "fp16": False,
    "loss_scale": None,
    "initial_loss_scale": 2**32,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "attention_softmax_in_fp32": False,
    "accumulate_allreduce_grads_in_fp32": False,
    "grad_reduce_in_bf16": False,
    "fp16_lm_cross_entropy": False,
    "gradient_accumulation_fusion": True,
    "masked_softmax_fusion": True,
    "bias_gelu_fusion": True,
    "bias_swiglu_fusion": True,
    "bias_dropout_fusion": True,
    "apply_rope_fusion": True,
    # optimizer and schedules
    "optimizer": "adam",
    "lr": None,
    "min_lr": 0.0,
    "decoupled_lr": None,
    "decoupled_min_lr": None,
    "weight_decay": 0.01,
    "clip_grad": 1.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "sgd_momentum": 0.9,
    "lr_decay_style": "linear",
    "lr_decay_iters": None,
    "lr_decay_samples": None,
    "lr_warmup_fraction": None,
    "lr_warmup_iters": 0,
    "lr_warmup_samples": 0,
    "lr_warmup_init": 0.0,
    "lr_wsd_decay_style": "exponential",
    "lr_wsd_decay_iters": None,
    "lr_wsd_decay_samples": None,
    "start_weight_decay": None,
    "end_weight_decay": None,
    "weight_decay_incr_style": "constant",
    "override_opt_param_scheduler": False,
    "use_checkpoint_opt_param_scheduler": False,
    # batch and iterations
    "micro_batch_size": None,
    "global_batch_size": None,
    "rampup_batch_size": None,
    "train_iters": None,
    "train_samples": None,
    "exit_interval": None,
    "exit_duration_in_mins": None,
    "exit_signal_handler": False,
    "manual_gc": False,
    "empty_unused_memory_level": 0,
    "eval_iters": 100,
    "eval_interval": None,
    "skip_train": False,
    "seed": 1234,
    "data_parallel_random_init": False,
    # data and tokenizer
    "data_path": None,
    "split": None,
    "train_data_path": None,
    "valid_data_path": None,
    "test_data_path": None,
    "data_args_path": None,
    "per_split_data_args_path": None,
    "data_cache_path": None,
    "mock_data": False,
    "mmap_bin_files": True,
    "num_workers": 2,
    "dataloader_type": None,
    "reset_position_ids": False,
    "reset_attention_mask": False,
    "eod_mask_loss": False,
    "create_attention_mask_in_dataloader": True,
    "num_dataset_builder_threads": 1,
    "mid_level_dataset_surplus": 0.005,
    "tokenizer_type": None,
    "tokenizer_model": None,
    "vocab_file": None,
    "merge_file": None,
    "vocab_size": None,
    "vocab_extra_ids": 0,
    # checkpointing
    "save": None,
    "load": None,
    "save_interval": None,
    "no_save_optim": None,
    "no_save_rng": None,
    "no_load_optim": None,
    "no_load_rng": None,
    "finetune": False,
    "pretrained_checkpoint": None,
    "use_checkpoint_args": False,
    "exit_on_missing_checkpoint": False,
    "ckpt_format": "torch_dist",
    "async_save": False,
    "ckpt_fully_parallel_save": True,
    "ckpt_fully_parallel_load": False,
    # logging
    "log_interval": 100,
    "log_throughput": False,
    "log_params_norm": False,
    "log_num_zeros_in_grad": False,
    "timing_log_level": 0,
    "timing_log_option": "minmax",
    "tensorboard_dir": None,
    "tensorboard_log_interval": 1,
    "tensorboard_queue_size": 1000,
    "log_timers_to_tensorboard": False,
    "log_validation_ppl_to_tensorboard": False,
    "log_memory_to_tensorboard": False,
    "log_loss_scale_to_tensorboard": True,
    "wandb_project": None,
    "wandb_exp_name": None,
    "wandb_save_dir": None,
    "wandb_entity": None,
    "check_for_nan_in_loss_and_grad": True,
    "barrier_with_L1_time": True,
    "spec": None,
    "yaml_cfg": None,
}


def test_defaults_are_megatron_lms():
    args = vars(parse_args_list([]))
    differences = {name: (args[name], value) for name, value in MEGATRON_DEFAULTS.items() if args[name] != value}
    assert differences == {}, "(ours, Megatron-LM's)"


def test_defaults_that_differ_from_megatron_lm_on_purpose():
    args = parse_args_list([])
    # Megatron-LM: transformer_engine, built here as PyTorch modules in its checkpoint layout (docs/compatibility.md)
    assert args.transformer_impl == "local"
    assert (args.dry_run, args.peak_flops) == (False, None)  # this project's additions


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        (["--override-opt_param-scheduler"], "override_opt_param_scheduler", True),
        (["--override-opt-param-scheduler"], "override_opt_param_scheduler", True),
        (["--use-checkpoint-opt-param-scheduler"], "use_checkpoint_opt_param_scheduler", True),
        (["--persistent-save-interval", "7"], "save_interval", 7),
        (["--disable-bias-linear"], "add_bias_linear", False),
        (["--no-rope-fusion"], "apply_rope_fusion", False),
        (["--norm-epsilon", "1e-6"], "layernorm_epsilon", 1e-6),
        (["--apply-layernorm-1p"], "layernorm_zero_centered_gamma", True),
        (["--microbatch-group-size-per-virtual-pipeline-stage", "3"], "microbatch_group_size_per_vp_stage", 3),
        (["--no-overlap-p2p-communication"], "overlap_p2p_comm", False),
        (["--use-mcore-models"], "deprecated_use_mcore_models", True),
        (["--attention-backend", "flash"], "attention_backend", AttnBackend.flash),
        (["--data-path", "0.3", "a", "0.7", "b"], "data_path", ["0.3", "a", "0.7", "b"]),
        (["--no-create-attention-mask-in-dataloader"], "create_attention_mask_in_dataloader", False),
        (["--no-mmap-bin-files"], "mmap_bin_files", False),
        (["--data-cache-path", "/tmp/c"], "data_cache_path", "/tmp/c"),
        (["--ddp-bucket-size", "1000"], "ddp_bucket_size", 1000),
        (["--no-ckpt-fully-parallel-save"], "ckpt_fully_parallel_save", False),
        (["--no-barrier-with-level-1-timing"], "barrier_with_L1_time", False),
        (["--num-experts", "8"], "num_experts", 8),
        (["--recompute-modules", "core_attn", "mlp"], "recompute_modules", ["core_attn", "mlp"]),
    ],
)
def test_flag_names_and_dests_are_megatron_lms(argv, dest, value):
    assert getattr(parse_args_list(argv), dest) == value


def test_attention_backend_names_the_choices():
    with pytest.raises(SystemExit):
        parse_args_list(["--attention-backend", "cudnn"])


def test_abbreviations_are_not_accepted():
    with pytest.raises(SystemExit):
        parse_args_list(["--num-lay", "4"])


def test_unknown_flags_fail_unless_ignored():
    with pytest.raises(SystemExit):
        parse_args_list(["--no-such-flag"])
    assert parse_args_list(["--no-such-flag", "--seed", "7"], ignore_unknown_args=True).seed == 7


def test_extra_args_provider_adds_flags():
    def provider(parser):
        parser.add_argument_group(title="mine").add_argument("--my-flag", type=int, default=3)
        return parser

    assert parse_args_list(["--my-flag", "5"], provider).my_flag == 5


def test_rank_and_world_size_come_from_torchrun(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = parse_args_list([])
    assert (args.rank, args.world_size) == (3, 8)


# ---- derived values -----------------------------------------------------------------------------------------------


def test_parallel_sizes_and_batch_defaults():
    args = validated("--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2, world_size=8)
    assert (args.data_parallel_size, args.global_batch_size) == (2, 4)
    assert args.expert_tensor_parallel_size == 2
    assert (args.consumed_train_samples, args.consumed_valid_samples, args.skipped_train_samples) == (0, 0, 0)
    assert (args.dataloader_type, args.variable_seq_lengths) == ("single", False)


def test_model_shape_defaults():
    args = validated()
    assert (args.ffn_hidden_size, args.kv_channels) == (256, 16)
    # SwiGLU: 2/3 of 4h rounded down to a multiple of 64 (4096 -> 10880, as Megatron-LM).
    args = validated("--swiglu", "--hidden-size", 4096, "--num-attention-heads", 32)
    assert args.ffn_hidden_size == 10880


@pytest.mark.parametrize(
    "flags, vpp",
    [
        (["--num-layers-per-virtual-pipeline-stage", "2"], 2),
        (["--num-virtual-stages-per-pipeline-rank", "4"], 4),
        (["--num-layers-per-virtual-pipeline-stage", "4"], None),  # one chunk per rank: not interleaved
        ([], None),
    ],
)
def test_virtual_pipeline_size_from_either_flag(flags, vpp):
    args = validated("--num-layers", 8, "--pipeline-model-parallel-size", 2, *flags, world_size=2)
    assert args.virtual_pipeline_model_parallel_size == vpp
    assert args.overlap_p2p_comm == (vpp is not None)
    assert args.align_param_gather == (vpp is not None)


def test_uneven_first_and_last_stages():
    args = validated(
        "--num-layers",
        12,
        "--pipeline-model-parallel-size",
        4,
        "--decoder-first-pipeline-num-layers",
        2,
        "--decoder-last-pipeline-num-layers",
        2,
        "--num-virtual-stages-per-pipeline-rank",
        2,
        world_size=4,
    )
    assert args.virtual_pipeline_model_parallel_size == 2
    config = core_transformer_config_from_args(args)
    assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (2, 2)


def test_precision_and_its_consequences():
    assert validated().params_dtype == torch.float32
    args = validated("--bf16")
    assert (args.params_dtype, args.accumulate_allreduce_grads_in_fp32) == (torch.bfloat16, True)
    assert validated("--bf16", "--grad-reduce-in-bf16").accumulate_allreduce_grads_in_fp32 is False
    args = validated("--fp16")
    assert (args.params_dtype, args.check_for_nan_in_loss_and_grad) == (torch.float16, False)
    assert validated("--fp16", "--loss-scale", 1024).check_for_nan_in_loss_and_grad is True
    assert validated("--apply-query-key-layer-scaling").attention_softmax_in_fp32 is True


def test_recompute_activations_means_selective():
    assert validated("--recompute-activations").recompute_granularity == "selective"


def test_weight_decay_range_and_biases():
    args = validated("--weight-decay", 0.1)
    assert (args.start_weight_decay, args.end_weight_decay) == (0.1, 0.1)
    assert validated().add_qkv_bias is True  # biases everywhere include the QKV bias
    args = validated("--disable-bias-linear")
    assert (args.add_qkv_bias, args.bias_gelu_fusion) == (False, False)


def test_positions_and_legacy_split():
    args = validated("--position-embedding-type", "rope", base=without("--max-position-embeddings"))
    assert args.max_position_embeddings == 32
    args = validated("--data-path", BUILTIN_PREFIX, base=without("--mock-data", takes_value=False))
    assert args.split == "969, 30, 1"


def test_script_defaults_apply_only_to_unset_arguments(capsys):
    args = validated(defaults={"tokenizer_model": "from-script", "seed": 99})
    assert (args.tokenizer_model, args.seed) == ("from-script", 1234)
    assert "overriding default arguments for seed:99 with seed:1234" in capsys.readouterr().out


def test_sequence_parallel_is_turned_off_without_tensor_parallelism():
    warn_once.cache_clear()
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect with --tensor-model-parallel-size 1"):
        args = validated("--sequence-parallel")
    assert args.sequence_parallel is False


def test_dry_run_and_skip_train_need_no_training_length_or_lr():
    base = without("--lr", base=without("--train-iters"))
    assert validated("--skip-train", base=base).train_iters is None
    assert validated("--dry-run", base=without("--mock-data", base=base, takes_value=False)).lr is None


# ---- every validation error ---------------------------------------------------------------------------------------

ERRORS = [
    ([], dict(base=without("--num-layers")), "missing required arguments: --num-layers; give each a value"),
    (["--hidden-size", "0"], {}, r"--hidden-size must be a positive integer, got 0"),
    (["--eval-iters", "-1"], {}, r"--eval-iters must be an integer >= 0, got -1"),
    (
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        dict(world_size=6),
        r"world size \(6\) is not divisible by --tensor-model-parallel-size \(2\) x --pipeline-model-parallel-size "
        r"\(2\) x --context-parallel-size \(1\) = 4",
    ),
    (
        ["--context-parallel-size", "3"],
        dict(world_size=3),
        r"--seq-length 32 is not divisible by 2 x --context-parallel-size = 6",
    ),
    (
        [
            "--context-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "4",
            "--sequence-parallel",
            "--seq-length",
            "20",
        ],
        dict(world_size=8),
        r"--sequence-parallel splits each CP rank's 10 tokens over "
        r"--tensor-model-parallel-size 4, which does not divide them; use a --seq-length divisible by 8",
    ),
    (
        ["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "2"],
        dict(world_size=2),
        r"--hierarchical-context-parallel-sizes 2 2 multiply to 4, not --context-parallel-size 2",
    ),
    (["--cp-comm-type", "ring"], {}, r"--cp-comm-type ring is not one of p2p, all_gather, a2a, a2a\+p2p"),
    (
        ["--cp-comm-type", "p2p", "a2a"],
        {},
        r"--cp-comm-type has 2 values; give one, or one per layer "
        r"\(--num-layers 4\)",
    ),
    (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
        ],
        dict(world_size=2),
        "give only one of them",
    ),
    (["--num-virtual-stages-per-pipeline-rank", "2"], {}, r"needs --pipeline-model-parallel-size > 1"),
    (
        ["--num-layers", "5", "--pipeline-model-parallel-size", "2"],
        dict(world_size=2),
        r"--num-layers \(5\) is not divisible by --pipeline-model-parallel-size \(2\)",
    ),
    (
        ["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"],
        dict(world_size=2),
        r"--num-layers \(4\) \+ embedding/loss \(1\) = 5 is not divisible by --pipeline-model-parallel-size \(2\)",
    ),
    (["--decoder-first-pipeline-num-layers", "1"], {}, r"need --pipeline-model-parallel-size > 1"),
    (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--decoder-first-pipeline-num-layers",
            "1",
            "--account-for-loss-in-pipeline-split",
        ],
        dict(world_size=2),
        "cannot be combined with --account-for",
    ),
    (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--decoder-first-pipeline-num-layers",
            "1",
            "--decoder-last-pipeline-num-layers",
            "1",
        ],
        dict(world_size=2),
        r"--num-layers \(4\) does not match --decoder-first-pipeline-num-layers \(1\) \+ "
        r"--decoder-last-pipeline-num-layers \(1\) on 2 pipeline stages; make them add up to at most --num-layers",
    ),
    (
        [
            "--num-layers",
            "8",
            "--pipeline-model-parallel-size",
            "4",
            "--decoder-first-pipeline-num-layers",
            "1",
            "--decoder-last-pipeline-num-layers",
            "2",
        ],
        dict(world_size=4),
        "the 5 layers left after --decoder-first/last-pipeline-num-layers do not divide evenly over the other 2 "
        "pipeline stages",
    ),
    (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--decoder-first-pipeline-num-layers",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
        dict(world_size=2),
        "set the virtual pipeline size with --num-virtual-stages-per-pipeline-rank",
    ),
    (
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
        dict(world_size=2),
        r"each pipeline stage has 2 layers, not divisible by --num-layers-per-virtual-pipeline-stage \(3\)",
    ),
    (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
            "--no-overlap-p2p-communication",
        ],
        dict(world_size=2),
        r"needs --pipeline-model-parallel-size > 2 \(got 2\)",
    ),
    (
        [
            "--num-layers",
            "6",
            "--pipeline-model-parallel-size",
            "2",
            "--decoder-first-pipeline-num-layers",
            "3",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
        ],
        dict(world_size=2),
        r"pipeline stage 0 has 3 layers, not divisible by --num-virtual-stages-per-pipeline-rank \(2\)",
    ),
    (
        ["--global-batch-size", "5"],
        {},
        r"--global-batch-size \(5\) must be a multiple of --micro-batch-size \(2\) x data-parallel size \(1\) = 2",
    ),
    (
        ["--global-batch-size", "4", "--decrease-batch-size-if-needed"],
        dict(world_size=4),
        r"--global-batch-size \(4\) must be a multiple of .* = 8",
    ),
    (["--swiglu", "--squared-relu"], {}, "--swiglu and --squared-relu choose different MLP activations"),
    (["--swiglu", "--hidden-size", "16"], {}, "--swiglu with --hidden-size 16 gives an FFN size of 0"),
    (["--hidden-size", "66"], {}, r"--hidden-size \(66\) is not divisible by --num-attention-heads \(4\)"),
    (
        ["--tensor-model-parallel-size", "3", "--hidden-size", "48", "--ffn-hidden-size", "96"],
        dict(world_size=3),
        r"--num-attention-heads \(4\) must be divisible by --tensor-model-parallel-size \(3\)",
    ),
    (
        ["--group-query-attention", "--num-query-groups", "3"],
        {},
        r"--num-attention-heads \(4\) must be a multiple of --num-query-groups \(3\)",
    ),
    (
        ["--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "1"],
        dict(world_size=2),
        r"--num-query-groups \(1\) must be divisible by --tensor-model-parallel-size \(2\)",
    ),
    (
        ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "99"],
        dict(world_size=2),
        r"--ffn-hidden-size \(99\) must be divisible by --tensor-model-parallel-size \(2\)",
    ),
    (["--hidden-dropout", "1.0"], {}, r"--hidden-dropout must be in \[0, 1\), got 1.0"),
    (
        [],
        dict(base=without("--max-position-embeddings")),
        "--max-position-embeddings is required with --position-embedding-type learned_absolute",
    ),
    (["--max-position-embeddings", "16"], {}, r"--seq-length \(32\) is larger than --max-position-embeddings \(16\)"),
    (["--use-rope-scaling"], {}, "--use-rope-scaling needs --position-embedding-type rope"),
    (["--rotary-percent", "0"], {}, r"--rotary-percent must be in \(0, 1\], got 0.0"),
    (["--fp16", "--bf16"], {}, "--fp16 and --bf16 are both set; choose one"),
    (["--fp16-lm-cross-entropy"], {}, "--fp16-lm-cross-entropy needs --fp16"),
    (["--fp32-residual-connection"], {}, "--fp32-residual-connection needs --fp16 or --bf16"),
    (["--recompute-granularity", "full"], {}, "--recompute-granularity full needs --recompute-method"),
    (["--recompute-method", "uniform"], {}, "apply to --recompute-granularity full only"),
    (["--recompute-modules", "mlp"], {}, "--recompute-modules applies to --recompute-granularity selective only"),
    (["--distribute-saved-activations"], {}, "--distribute-saved-activations needs --tensor-model-parallel-size > 1"),
    (
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--distribute-saved-activations",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        dict(world_size=2),
        "cannot be combined with --sequence-parallel",
    ),
    (["--train-samples", "100"], {}, "--train-iters or --train-samples, not both"),
    (["--lr-decay-samples", "100"], {}, "--lr-decay-samples counts samples, but --train-iters counts iterations"),
    (
        ["--train-samples", "100", "--lr-warmup-iters", "5"],
        dict(base=without("--train-iters")),
        "--lr-warmup-iters counts iterations, but --train-samples counts samples",
    ),
    ([], dict(base=without("--train-iters")), "give the training length: --train-iters N or --train-samples N"),
    (["--lr-warmup-fraction", "1.5"], {}, r"--lr-warmup-fraction must be in \[0, 1\], got 1.5"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], {}, "give the warm-up once"),
    ([], dict(base=without("--lr")), r"--lr \(the peak learning rate\) is required for training"),
    (["--min-lr", "0.1"], {}, r"--min-lr \(0.1\) is larger than --lr \(0.001\)"),
    (["--lr-decay-style", "WSD"], {}, "--lr-decay-style WSD needs the length of its annealing phase"),
    (["--start-weight-decay", "0.1"], {}, "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style"),
    (
        ["--weight-decay-incr-style", "linear"],
        {},
        "--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay",
    ),
    (["--overlap-param-gather"], {}, "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad"),
    (
        ["--num-distributed-optimizer-instances", "2"],
        {},
        r"not supported yet: several distributed-optimizer instances \(--num-distributed-optimizer-instances 2\)",
    ),
    (["--data-path", BUILTIN_PREFIX, "--data-args-path", "x"], {}, "--data-path and --data-args-path both give"),
    (
        ["--train-data-path", BUILTIN_PREFIX, "--per-split-data-args-path", "x"],
        {},
        "--train/valid/test-data-path and --per-split-data-args-path both give the data",
    ),
    (["--data-path", BUILTIN_PREFIX], {}, "give one source of data, got --mock-data and --data-path"),
    ([], dict(base=without("--mock-data", takes_value=False)), "no data: give --data-path PREFIX"),
    (
        ["--train-data-path", BUILTIN_PREFIX, "--split", "1,1,1"],
        dict(base=without("--mock-data", takes_value=False)),
        "--split does not apply to --train/valid/test-data-path",
    ),
    (
        ["--data-args-path", "/no/such/list.txt"],
        dict(base=without("--mock-data", takes_value=False)),
        "--data-args-path /no/such/list.txt: file not found",
    ),
    (
        ["--data-path", "/no/such/prefix"],
        dict(base=without("--mock-data", takes_value=False)),
        "--data-path: no dataset at /no/such/prefix",
    ),
    (
        ["--valid-data-path", "0.5", BUILTIN_PREFIX, "x", BUILTIN_PREFIX],
        dict(base=without("--mock-data", takes_value=False)),
        "--valid-data-path: cannot tell weights from prefixes",
    ),
    ([], dict(base=without("--tokenizer-type")), "--tokenizer-type is required"),
    (["--tokenizer-type", "GPT2BPETokenizer"], {}, "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], {}, "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
    (["--save", "/tmp/ckpt"], {}, "--save needs --save-interval N"),
    (["--use-checkpoint-args"], {}, "--use-checkpoint-args needs --load"),
    (["--wandb-project", "p"], {}, "--wandb-project needs --wandb-exp-name"),
    (["--wandb-project", "p", "--wandb-exp-name", "run"], {}, "--wandb-project needs --wandb-save-dir or --save"),
    (["--peak-flops", "-1"], {}, "--peak-flops must be a positive number of TFLOP/s, got -1.0"),
]


@pytest.mark.parametrize("extra, options, message", ERRORS, ids=[message[:50] for _, _, message in ERRORS])
def test_validation_error(extra, options, message):
    with pytest.raises(ValueError, match=message):
        validated(*extra, **options)


def test_range_and_required_checks_name_real_flags():
    flags = {option for action in build_parser()._actions for option in action.option_strings}
    checked = argument_validation._POSITIVE_INTS + argument_validation._NON_NEGATIVE_INTS
    named = [flag_for(name) for name in checked + argument_validation._REQUIRED]
    assert [flag for flag in named if flag not in flags] == []
    with pytest.raises(ValueError, match="--microbatch-group-size-per-virtual-pipeline-stage must be a positive"):
        validated("--microbatch-group-size-per-virtual-pipeline-stage", 0)


@pytest.mark.parametrize(
    "extra, world_size",
    [
        (["--num-layers", "5", "--pipeline-model-parallel-size", "2"], 2),
        (["--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split"], 2),
        (["--decoder-last-pipeline-num-layers", "1"], 1),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--decoder-first-pipeline-num-layers",
                "1",
                "--account-for-embedding-in-pipeline-split",
            ],
            2,
        ),
        (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "5"], 2),
        (["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--decoder-last-pipeline-num-layers", "1"], 4),
        (
            ["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"],
            2,
        ),
    ],
)
def test_pipeline_split_errors_name_flags_not_config_fields(extra, world_size):
    """transformer_block's split errors name TransformerConfig fields; validate_args renames each to its flag."""
    flags = {option for action in build_parser()._actions for option in action.option_strings}
    renamed = [flag for flag in argument_validation._SPLIT_FIELD_FLAGS.values() if "/" not in flag]
    assert [flag for flag in renamed if flag not in flags] == []
    with pytest.raises(ValueError) as raised:
        validated(*extra, world_size=world_size)
    message = str(raised.value)
    assert "--" in message and not re.search(r"\b[a-z]+(_[a-z]+)+\b", message), message


# ---- what cannot run on this machine ------------------------------------------------------------------------------


def test_gpu_only_settings_are_turned_off_with_one_warning(monkeypatch):
    monkeypatch.setattr(argument_validation, "cuda_available", lambda: False)
    warn_once.cache_clear()
    base = [item for item in BASE if item not in QUIET]
    with pytest.warns(UserWarning) as record:
        args = validated("--transformer-impl", "transformer_engine", "--cross-entropy-loss-fusion", base=base)
    assert len(record) == 1
    message = str(record[0].message)
    assert "--distributed-backend nccl needs CUDA GPUs: using gloo" in message
    assert "Transformer Engine" not in message  # the Transformer Engine layout is built, and says so itself
    assert (args.distributed_backend, args.transformer_impl) == ("gloo", "transformer_engine")
    # megatron.core.fusions runs every fusion on every device: they stay on, unmentioned.
    kept = ("bias_gelu_fusion", "bias_swiglu_fusion", "cross_entropy_loss_fusion", "gradient_accumulation_fusion")
    kept += ("masked_softmax_fusion", "bias_dropout_fusion")
    assert all(getattr(args, name) for name in kept) and args.no_persist_layer_norm is False
    assert not any(name in message for name in (*kept, "persist_layer_norm", "rope", "softmax", "dropout"))


def test_gradient_accumulation_fusion_is_on_by_default_and_off_with_fsdp2():
    base = [item for item in BASE if item != "--no-gradient-accumulation-fusion"]
    assert validated(base=base).gradient_accumulation_fusion  # Megatron-LM's CLI default
    assert not validated(base=BASE).gradient_accumulation_fusion
    warn_once.cache_clear()
    # FSDP2 keeps its gradients in param.grad: nothing to accumulate into, so the fusion goes off with one notice.
    with pytest.warns(UserWarning) as record:
        args = validated("--use-torch-fsdp2", "--untie-embeddings-and-output-weights", base=base)
    assert not args.gradient_accumulation_fusion
    assert [str(r.message) for r in record] == [
        "--use-torch-fsdp2 keeps no main_grad for gradient accumulation fusion to accumulate into: fusion off; "
        "pass --no-gradient-accumulation-fusion to silence this"
    ]


def test_nothing_to_turn_off_means_no_warning():
    warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validated()


# ---- config builders ----------------------------------------------------------------------------------------------


def test_transformer_config_from_args():
    args = validated(
        "--swiglu",
        "--group-query-attention",
        "--num-query-groups",
        2,
        "--norm-epsilon",
        1e-6,
        "--apply-layernorm-1p",
        "--normalization",
        "RMSNorm",
        "--bf16",
        "--attention-backend",
        "unfused",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        1,
    )
    config = core_transformer_config_from_args(args)
    assert isinstance(config, TransformerConfig)
    assert (config.activation_func, config.gated_linear_unit, config.ffn_hidden_size) == (F.silu, True, 128)
    assert (config.num_query_groups, config.kv_channels) == (2, 16)
    assert (config.layernorm_epsilon, config.layernorm_zero_centered_gamma, config.normalization) == (
        1e-6,
        True,
        "RMSNorm",
    )
    assert (config.params_dtype, config.pipeline_dtype, config.bf16) == (torch.bfloat16, torch.bfloat16, True)
    assert config.attention_backend == AttnBackend.unfused
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 1)
    assert (config.deallocate_pipeline_outputs, config.batch_p2p_comm) == (True, True)
    assert (config.bias_activation_fusion, config.persist_layer_norm, config.masked_softmax_fusion) == (
        False,
        False,
        False,
    )


def test_transformer_config_activation_heads_and_class():
    config = core_transformer_config_from_args(validated("--squared-relu", "--num-query-groups", 2))
    assert config.activation_func is squared_relu
    assert config.num_query_groups == 4  # without --group-query-attention: multi-head attention

    @dataclass
    class MyConfig(TransformerConfig):
        my_field: int = 7

    assert type(core_transformer_config_from_args(validated(), MyConfig)) is MyConfig


def test_ddp_and_optimizer_configs_from_args():
    args = validated(
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        1000,
        "--ddp-average-in-collective",
        "--bf16",
        "--adam-beta2",
        0.95,
        "--min-lr",
        1e-4,
        "--clip-grad",
        0.5,
        "--loss-scale",
        128,
    )
    ddp = core_ddp_config_from_args(args)
    assert (ddp.use_distributed_optimizer, ddp.overlap_grad_reduce, ddp.overlap_param_gather) == (True, True, True)
    assert (ddp.bucket_size, ddp.average_in_collective, ddp.grad_reduce_in_fp32) == (1000, True, True)
    assert ddp.check_for_nan_in_grad is True
    optimizer = core_optimizer_config_from_args(args)
    assert (optimizer.lr, optimizer.min_lr, optimizer.adam_beta2, optimizer.clip_grad) == (1e-3, 1e-4, 0.95, 0.5)
    assert (optimizer.bf16, optimizer.params_dtype, optimizer.loss_scale) == (True, torch.bfloat16, 128)
    assert optimizer.use_distributed_optimizer is True


def test_gpt_dataset_config_for_mock_data_and_data_path():
    tokenizer = NullTokenizer(100)
    config = core_gpt_dataset_config_from_args(validated("--eod-mask-loss", "--seed", 5), tokenizer)
    assert (config.mock, config.split, config.random_seed, config.sequence_length) == (True, "1,1,1", 5, 32)
    assert (config.eod_mask_loss, config.create_attention_mask, config.tokenizer) == (True, True, tokenizer)
    args = validated(
        "--data-path",
        BUILTIN_PREFIX,
        "--split",
        "98,2,0",
        "--no-create-attention-mask-in-dataloader",
        "--data-cache-path",
        "/tmp/cache",
        base=without("--mock-data", takes_value=False),
    )
    config = core_gpt_dataset_config_from_args(args, tokenizer)
    assert (config.blend, config.mock) == (([BUILTIN_PREFIX], None), False)
    assert (config.split_matrix[2], config.create_attention_mask, config.path_to_cache) == (None, False, "/tmp/cache")


def test_blends_from_files(tmp_path):
    args = parse("--data-args-path", tmp_path / "list.txt")
    (tmp_path / "list.txt").write_text("0.3 a\n0.7 b\n")
    assert get_blend_and_blend_per_split(args) == ((["a", "b"], [0.3, 0.7]), None)
    (tmp_path / "splits.json").write_text(json.dumps({"train": "t1 t2", "valid": ["v"], "test": ["1", "x"]}))
    args = parse("--per-split-data-args-path", tmp_path / "splits.json")
    assert get_blend_and_blend_per_split(args) == (None, [(["t1", "t2"], None), (["v"], None), (["x"], [1.0])])
    args = parse("--train-data-path", "t", "--test-data-path", "s")
    assert get_blend_and_blend_per_split(args) == (None, [(["t"], None), None, (["s"], None)])


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"train": ["a"]}), "no valid, test key; give all three"),
    ],
)
def test_bad_per_split_data_args_file(tmp_path, content, message):
    (tmp_path / "splits.json").write_text(content)
    with pytest.raises(ValueError, match=f"--per-split-data-args-path {tmp_path}/splits.json: {message}"):
        get_blend_and_blend_per_split(parse("--per-split-data-args-path", tmp_path / "splits.json"))


# ---- flags generated from dataclass fields ------------------------------------------------------------------------


class Color(Enum):
    red = 1
    blue = 2


@dataclass
class Example:
    count: int = 3
    """How many."""
    ratio: Optional[float] = None
    """A ratio
    over two lines."""
    enabled: bool = False
    """Switch it on."""
    fused: bool = True
    """Fuse the things."""
    color: Color = Color.red
    """Which color."""
    sizes: Optional[List[int]] = None
    """Some sizes (`--sizes`)."""
    func: Optional[Callable] = None
    """A callable."""
    undocumented: int = 0


def test_flags_generated_from_documented_fields():
    import argparse

    parser = argparse.ArgumentParser()
    for name in ("count", "ratio", "enabled", "fused", "color", "sizes"):
        add_field_argument(parser, Example, name)
    args = parser.parse_args(
        ["--count", "5", "--ratio", "0.5", "--enabled", "--no-fused", "--color", "blue", "--sizes", "1", "2"]
    )
    assert vars(args) == {
        "count": 5,
        "ratio": 0.5,
        "enabled": True,
        "fused": False,
        "color": Color.blue,
        "sizes": [1, 2],
    }
    assert vars(parser.parse_args([])) == {
        "count": 3,
        "ratio": None,
        "enabled": False,
        "fused": True,
        "color": Color.red,
        "sizes": None,
    }
    helps = {action.dest: action.help for action in parser._actions}
    assert helps["ratio"] == "A ratio over two lines."
    assert helps["fused"] == "Turn off (on by default): fuse the things."
    assert helps["sizes"] == "Some sizes."


def test_field_docs_include_inherited_fields():
    docs = config_field_docs(TransformerConfig)
    assert docs["tensor_model_parallel_size"] == "Number of tensor-parallel ranks a layer's weights are split over."
    assert docs["num_layers"].startswith("Number of transformer layers")


@pytest.mark.parametrize(
    "name, error, message",
    [
        ("undocumented", ValueError, "Example.undocumented has no docstring to use as --help text"),
        ("func", TypeError, r"cannot derive a command-line type for Example.func"),
        ("missing", ValueError, "Example has no field 'missing'"),
    ],
)
def test_fields_that_cannot_become_flags(name, error, message):
    import argparse

    with pytest.raises(error, match=message):
        add_field_argument(argparse.ArgumentParser(), Example, name)
