"""The memory-saving flags on the command line: the precision-aware optimizer (--use-precision-aware-optimizer with
--main-params-dtype / --main-grads-dtype / --exp-avg-dtype / --exp-avg-sq-dtype), optimizer CPU offload
(--optimizer-cpu-offload, --optimizer-offload-fraction) and activation offloading (--cpu-offloading-num-layers,
--fine-grained-activation-offloading, --offload-modules, --min-offloaded-tensor-size) reach the configs, and every
bad combination fails at start-up with one message naming the flags."""

import pytest
import torch

from megatron.training.arguments import core_optimizer_config_from_args, core_transformer_config_from_args
from tests.unit_tests.training.test_arguments import validated

DIST_OPT = ("--bf16", "--use-distributed-optimizer")


def test_precision_aware_flags_reach_the_optimizer_config():
    args = validated(
        *DIST_OPT,
        "--use-precision-aware-optimizer",
        "--exp-avg-dtype",
        "bf16",
        "--exp-avg-sq-dtype",
        "bf16",
        "--main-grads-dtype",
        "bf16",
        "--main-params-dtype",
        "fp16",
    )
    config = core_optimizer_config_from_args(args)
    assert config.use_precision_aware_optimizer
    assert (config.exp_avg_dtype, config.exp_avg_sq_dtype) == (torch.bfloat16, torch.bfloat16)
    assert (config.main_grads_dtype, config.main_params_dtype) == (torch.bfloat16, torch.float16)


def test_offload_flags_reach_the_configs():
    args = validated(
        *DIST_OPT, "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.25", "--cpu-offloading-num-layers", "2"
    )
    optimizer = core_optimizer_config_from_args(args)
    assert optimizer.optimizer_cpu_offload and optimizer.optimizer_offload_fraction == 0.25
    transformer = core_transformer_config_from_args(args)
    assert transformer.cpu_offloading and transformer.cpu_offloading_num_layers == 2
    args = validated(
        "--fine-grained-activation-offloading",
        "--offload-modules",
        "core_attn",
        "attn_proj",
        "--min-offloaded-tensor-size",
        "4096",
    )
    transformer = core_transformer_config_from_args(args)
    assert transformer.fine_grained_activation_offloading and not transformer.cpu_offloading
    assert transformer.offload_modules == ["core_attn", "attn_proj"]
    assert transformer.min_offloaded_tensor_size == 4096


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            (*DIST_OPT, "--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8"),
            "--exp-avg-dtype fp8 needs an fp8 scaling recipe: give --fp8-format (with --fp8-recipe), or store "
            "the moments in 16 bits (--exp-avg-dtype bf16)",
        ),
        (
            (*DIST_OPT, "--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"),
            "--exp-avg-sq-dtype fp8 needs an fp8 scaling recipe",
        ),
        (
            ("--bf16", "--use-precision-aware-optimizer"),
            "--use-precision-aware-optimizer needs --use-distributed-optimizer",
        ),
        (("--bf16", "--exp-avg-dtype", "bf16"), "needs --use-precision-aware-optimizer"),
        (
            (*DIST_OPT, "--use-precision-aware-optimizer", "--optimizer", "sgd"),
            "--use-precision-aware-optimizer needs --optimizer adam",
        ),
        (
            ("--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-params-dtype", "fp16"),
            "--main-params-dtype torch.float16 needs a bf16 or fp16 model",
        ),
        (
            ("--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"),
            "--optimizer-offload-fraction 1.5 is outside [0, 1]",
        ),
        (
            ("--optimizer-offload-fraction", "-0.5"),
            "--optimizer-offload-fraction -0.5 is outside [0, 1]",
        ),
        (("--cpu-offloading-num-layers", "4"), "--cpu-offloading-num-layers 4 must be between 1 and"),
        (
            ("--cpu-offloading-num-layers", "1", "--recompute-activations"),
            "does not work with activation recomputation",
        ),
        (("--fine-grained-activation-offloading",), "needs --offload-modules"),
        (
            ("--fine-grained-activation-offloading", "--offload-modules", "mlp"),
            "'mlp' is not a module that can be offloaded",
        ),
        (("--activation-offload-fraction", "0.5"), "not supported yet: activation offloading tuning"),
    ],
)
def test_bad_memory_flags_fail_naming_the_flags(flags, message):
    with pytest.raises(ValueError) as error:
        validated(*flags)
    assert message in str(error.value)


def test_precision_aware_optimizer_combines_with_cpu_offload():
    args = validated(*DIST_OPT, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--optimizer-cpu-offload")
    config = core_optimizer_config_from_args(args)
    assert config.use_precision_aware_optimizer and config.optimizer_cpu_offload
    assert config.optimizer_offload_fraction == 1.0  # Megatron-LM's command-line default
