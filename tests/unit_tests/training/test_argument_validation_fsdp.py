"""--use-megatron-fsdp on the command line: the flags reach the DDP config and the wrapper, and every flag it cannot
combine with is one error naming both flags and what to use instead."""

import pytest
import torch

from megatron.training.argument_utils import core_ddp_config_from_args
from tests.unit_tests.training.test_arguments import parse, validated

FSDP = ("--use-megatron-fsdp", "--use-distributed-optimizer")


def test_fsdp_flags_reach_the_ddp_config():
    args = validated(
        *FSDP,
        "--data-parallel-sharding-strategy",
        "optim_grads",
        "--megatron-fsdp-main-grads-dtype",
        "fp32",
        "--megatron-fsdp-grad-comm-dtype",
        "bf16",
    )
    config = core_ddp_config_from_args(args)
    assert config.use_megatron_fsdp and config.data_parallel_sharding_strategy == "optim_grads"
    assert config.megatron_fsdp_main_grads_dtype == torch.float32
    assert config.megatron_fsdp_grad_comm_dtype == torch.bfloat16
    assert config.megatron_fsdp_main_params_dtype == torch.float32


def test_auto_dtypes_are_the_config_defaults():
    config = core_ddp_config_from_args(validated(*FSDP, "--megatron-fsdp-main-params-dtype", "auto"))
    assert config.data_parallel_sharding_strategy == "optim_grads_params"  # Megatron-LM's default strategy
    assert config.megatron_fsdp_main_grads_dtype is None and config.megatron_fsdp_grad_comm_dtype is None
    assert config.megatron_fsdp_main_params_dtype == torch.float32


ERRORS = [
    (
        ("--use-megatron-fsdp",),
        "--use-megatron-fsdp with --data-parallel-sharding-strategy optim_grads_params .*add --use-distributed-"
        "optimizer, or use --data-parallel-sharding-strategy no_shard",
    ),
    (
        (*FSDP, "--data-parallel-sharding-strategy", "no_shard"),
        "no_shard and --use-distributed-optimizer: .*use --data-parallel-sharding-strategy optim",
    ),
    (
        (*FSDP, "--ckpt-format", "torch"),
        "--use-megatron-fsdp with --ckpt-format torch: .*use --ckpt-format fsdp_dtensor or torch_dist",
    ),
    (("--ckpt-format", "fsdp_dtensor"), "--ckpt-format fsdp_dtensor .*needs --use-megatron-fsdp"),
    (
        ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard", "--ckpt-format", "fsdp_dtensor"),
        "--ckpt-format fsdp_dtensor with --data-parallel-sharding-strategy no_shard: .*use --data-parallel-sharding-"
        "strategy optim .*or --ckpt-format torch_dist",
    ),
    (
        (*FSDP, "--ckpt-format", "fsdp_dtensor", "--optimizer", "muon"),
        "--optimizer muon with --ckpt-format fsdp_dtensor: .*use --optimizer adam or sgd, or --ckpt-format torch_dist",
    ),
    (
        (*FSDP, "--ckpt-format", "fsdp_dtensor", "--async-save", "--save", "/tmp/x", "--save-interval", "1"),
        "--async-save with --ckpt-format fsdp_dtensor: not supported yet.*drop --async-save",
    ),
    (
        (*FSDP, "--ckpt-format", "fsdp_dtensor", "--ckpt-convert-format", "torch")
        + ("--load", "/a", "--ckpt-convert-save", "/b"),
        "--ckpt-convert-format torch with --ckpt-format fsdp_dtensor: not supported yet",
    ),
    (
        (*FSDP, "--data-parallel-sharding-strategy", "optim", "--fsdp-double-buffer"),
        "--fsdp-double-buffer with --data-parallel-sharding-strategy optim: .*optim_grads_params or drop",
    ),
    (("--fsdp-double-buffer",), "--fsdp-double-buffer needs --use-megatron-fsdp"),
    (
        (*FSDP, "--megatron-fsdp-main-params-dtype", "bf16"),
        "--megatron-fsdp-main-params-dtype .*not supported yet.*fp32",
    ),
]


@pytest.mark.parametrize("extra, message", ERRORS, ids=[m[:40] for _, m in ERRORS])
def test_flags_fsdp_cannot_combine_with_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        validated(*extra)


def test_fsdp_dtensor_is_accepted_with_a_sharded_strategy():
    args = validated(*FSDP, "--ckpt-format", "fsdp_dtensor")
    assert args.ckpt_format == "fsdp_dtensor"


def test_parsing_alone_accepts_the_flags():
    assert parse(*FSDP, "--fsdp-double-buffer").fsdp_double_buffer


def test_megatron_fsdp_with_torch_fsdp2_is_refused():
    # Checked on the parsed flags directly: until --use-torch-fsdp2 is built, validate_args refuses it on its own.
    from megatron.training.argument_validation_fsdp import validate_megatron_fsdp

    args = parse(*FSDP, "--use-torch-fsdp2")
    with pytest.raises(ValueError, match="--use-megatron-fsdp and --use-torch-fsdp2 both shard the model.*use one"):
        validate_megatron_fsdp(args)
