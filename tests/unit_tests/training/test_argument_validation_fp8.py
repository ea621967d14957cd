"""The FP8 flags on the command line: they reach TransformerConfig, and each bad combination fails in
validate_args (before any process group exists) with one message naming the flags."""

import pytest

from megatron.training.arguments import core_transformer_config_from_args
from tests.unit_tests.training.test_arguments import validated


def test_fp8_flags_reach_the_config():
    args = validated(
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "delayed",
        "--fp8-margin",
        "1",
        "--fp8-amax-history-len",
        "16",
        "--fp8-amax-compute-algo",
        "max",
        "--no-fp8-wgrad",
        "--first-last-layers-bf16",
        "--num-layers-at-start-in-bf16",
        "2",
    )
    config = core_transformer_config_from_args(args)
    assert (config.fp8, config.fp8_recipe, config.fp8_margin) == ("hybrid", "delayed", 1)
    assert (config.fp8_amax_history_len, config.fp8_amax_compute_algo, config.fp8_wgrad) == (16, "max", False)
    assert (config.first_last_layers_bf16, config.num_layers_at_start_in_bf16) == (True, 2)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--fp8-recipe", "tensorwise"),
            "--fp8-recipe tensorwise has no effect without --fp8-format: add --fp8-format hybrid",
        ),
        (
            ("--fp8-format", "hybrid", "--fp8-recipe", "custom"),
            "not supported yet: custom FP8 recipes (--fp8-recipe custom with --fp8-quantizer-factory)",
        ),
        (
            ("--fp8-format", "e4m3", "--fp8-recipe", "blockwise"),
            "--fp8-recipe blockwise scales blocks of 128 elements along each linear layer's input dimension, but "
            "--hidden-size = 64 is not a multiple of 128",
        ),
        (
            ("--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--ffn-hidden-size", "80"),
            "--ffn-hidden-size / --tensor-model-parallel-size = 80 is not a multiple of 32",
        ),
        (
            ("--fp8-format", "hybrid", "--fp8-output-proj"),
            "not supported yet: FP8 output layer, custom FP8 quantizers and MXFP8 parameter all-gather into the "
            "gradient buffer (--fp8-output-proj)",
        ),
    ],
    ids=["recipe-without-format", "custom-recipe", "blockwise-128", "mxfp8-32", "output-proj"],
)
def test_bad_fp8_flags_fail_with_one_message(flags, message):
    with pytest.raises(ValueError) as raised:
        validated(*flags)
    assert message in str(raised.value)
