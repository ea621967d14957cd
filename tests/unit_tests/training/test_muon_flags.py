"""--optimizer muon / dist_muon and the --muon-* flags: read into OptimizerConfig, bad combinations named by flag."""

import pytest

from megatron.training.model_setup import get_megatron_optimizer_config
from tests.unit_tests.training.test_arguments import validated


def test_muon_flags_reach_the_optimizer_config():
    args = validated(
        "--optimizer",
        "dist_muon",
        "--muon-tp-mode",
        "duplicated",
        "--muon-nesterov",
        "--muon-no-split-qkv",
        "--muon-scale-mode",
        "unit_rms_norm",
        "--muon-coefficient-type",
        "polar_express",
        "--muon-num-ns-steps",
        "8",
    )
    config = get_megatron_optimizer_config(args)
    assert config.optimizer == "dist_muon" and config.muon_tp_mode == "duplicated"
    assert config.muon_nesterov and not config.muon_split_qkv and config.muon_scale_mode == "unit_rms_norm"
    assert (config.muon_coefficient_type, config.muon_num_ns_steps) == ("polar_express", 8)
    # Megatron-LM's flag default (0.9), not OptimizerConfig's field default (0.95).
    assert config.muon_momentum == 0.9 and config.muon_fp32_matmul_prec == "medium"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--optimizer", "muon", "--muon-num-ns-steps", "3"],
            "--muon-num-ns-steps 3 does not fit --muon-coefficient-type quintic: it must be a multiple of 5",
        ),
        (
            ["--optimizer", "dist_muon", "--use-distributed-optimizer"],
            "--optimizer dist_muon cannot shard its state with --use-distributed-optimizer (Newton-Schulz needs whole "
            "matrices); unset --use-distributed-optimizer",
        ),
        (
            ["--optimizer", "muon", "--use-distributed-optimizer"],
            "use --optimizer dist_muon (the layer-wise distributed optimizer) instead",
        ),
        (["--optimizer", "muon", "--fp16"], "--optimizer muon does not support fp16"),
    ],
)
def test_bad_muon_settings_name_their_flags(argv, message):
    with pytest.raises(ValueError) as raised:
        validated(*argv)
    assert message in str(raised.value)
