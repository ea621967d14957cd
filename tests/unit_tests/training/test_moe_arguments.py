"""Megatron-LM's MoE flags: parsed with its names and defaults, completed and checked by validate_args before any
process group exists, and carried into the TransformerConfig (pretrain_gpt's model then gets MoE layers)."""

import pytest
import torch

from megatron.training.argument_utils import core_transformer_config_from_args
from megatron.training.moe_logging import moe_track_names
from tests.unit_tests.training.test_arguments import validated

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


def test_moe_flags_reach_the_transformer_config():
    args = validated(
        *MOE,
        "--expert-model-parallel-size",
        "2",
        "--moe-ffn-hidden-size",
        "32",
        "--moe-layer-freq",
        "([0]+[1]*3)",
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
        "--moe-aux-loss-coeff",
        "1e-2",
        "--moe-z-loss-coeff",
        "1e-3",
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.01",
        "--moe-router-dtype",
        "fp32",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--moe-expert-capacity-factor",
        "1.5",
        "--moe-pad-expert-input-to-capacity",
        "--moe-token-drop-policy",
        "position",
        "--moe-grouped-gemm",
        "--moe-shared-expert-intermediate-size",
        "16",
        "--moe-shared-expert-gate",
        "--moe-per-layer-logging",
        "--moe-input-jitter-eps",
        "0.01",
        "--moe-router-num-groups",
        "2",
        "--moe-router-group-topk",
        "1",
        "--moe-router-topk-scaling-factor",
        "2.0",
        world_size=2,
    )
    config = core_transformer_config_from_args(args)
    assert (config.num_moe_experts, config.moe_router_topk, config.expert_model_parallel_size) == (4, 2, 2)
    assert config.expert_tensor_parallel_size == 1  # defaults to the TP size
    assert config.moe_layer_freq == [0, 1, 1, 1]
    # One-element lists become scalars, as Megatron-LM's validate_args does.
    assert config.moe_router_load_balancing_type == "seq_aux_loss" and config.moe_aux_loss_coeff == 0.01
    assert (config.moe_z_loss_coeff, config.moe_router_score_function, config.moe_router_dtype) == (
        1e-3,
        "sigmoid",
        "fp32",
    )
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.01
    assert (config.moe_token_dispatcher_type, config.moe_expert_capacity_factor, config.moe_token_drop_policy) == (
        "alltoall",
        1.5,
        "position",
    )
    assert config.moe_pad_expert_input_to_capacity and config.moe_grouped_gemm and config.moe_per_layer_logging
    assert (config.moe_shared_expert_intermediate_size, config.moe_shared_expert_gate) == (16, True)
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert (config.moe_input_jitter_eps, config.moe_router_topk_scaling_factor) == (0.01, 2.0)


def test_moe_defaults_are_megatron_lms():
    args = validated(*MOE, "--ffn-hidden-size", "96")
    assert args.moe_ffn_hidden_size == 96  # --moe-ffn-hidden-size defaults to --ffn-hidden-size
    assert (args.moe_layer_freq, args.moe_router_load_balancing_type, args.moe_aux_loss_coeff) == (1, "aux_loss", 0.0)
    assert (args.moe_token_dispatcher_type, args.moe_router_score_function, args.moe_token_drop_policy) == (
        "allgather",
        "softmax",
        "probs",
    )
    assert args.moe_router_bias_update_rate == 1e-3 and args.moe_z_loss_coeff is None
    assert validated("--moe-layer-freq", "2", *MOE).moe_layer_freq == 2


def test_several_load_balancing_types_keep_their_coefficient_lists():
    args = validated(
        *MOE,
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
        "global_aux_loss",
        "--moe-aux-loss-coeff",
        "1e-3",
        "1e-2",
    )
    assert args.moe_router_load_balancing_type == ["seq_aux_loss", "global_aux_loss"]
    assert args.moe_aux_loss_coeff == [1e-3, 1e-2]


@pytest.mark.parametrize(
    "argv, world_size, message",
    [
        (
            ["--expert-model-parallel-size", "2"],
            2,
            "--expert-model-parallel-size 2 needs an MoE model: set --num-experts",
        ),
        (
            ["--num-experts", "3", "--expert-model-parallel-size", "2"],
            2,
            r"--num-experts \(3\) is not divisible by --expert-model-parallel-size \(2\)",
        ),
        (MOE + ["--expert-model-parallel-size", "2", "--fp16"], 2, "does not support --fp16; use --bf16"),
        (
            MOE + ["--expert-model-parallel-size", "4"],
            2,
            r"world size \(2\) is not divisible by --expert-tensor-parallel-size \(1\) x --expert-model-parallel-size "
            r"\(4\) x --pipeline-model-parallel-size \(1\) = 4",
        ),
        (
            MOE + ["--moe-token-dispatcher-type", "flex"],
            1,
            r"not supported yet: the flex token dispatcher \(DeepEP / HybridEP kernels\) \(--moe-token-dispatcher-type "
            r"flex\)",
        ),
        (
            MOE + ["--moe-enable-deepep"],
            1,
            r"not supported yet: these mixture-of-experts options \(--moe-enable-deepep\)",
        ),
        # The config's own validation runs at start-up too, its message in flag terms.
        (["--num-experts", "2", "--moe-router-topk", "3"], 1, "--moe-router-topk 3 is larger than --num-experts 2"),
        (MOE + ["--moe-expert-capacity-factor", "1.0"], 1, "needs --moe-token-dispatcher-type alltoall"),
        (MOE + ["--moe-layer-freq", "[1,0]"], 1, r"must list 0 \(dense\) or 1 \(MoE\) for each of the --num-layers 4"),
    ],
)
def test_bad_moe_settings_fail_at_start_up(argv, world_size, message):
    with pytest.raises(ValueError, match=message):
        validated(*argv, world_size=world_size)


def test_moe_at_tp2_without_sequence_parallel_starts_as_in_megatron_lm():
    """Megatron-LM accepts it (evaluation and generation run; MoELayer refuses only the training forward)."""
    args = validated(*MOE, "--tensor-model-parallel-size", "2", world_size=2)
    config = core_transformer_config_from_args(args)
    assert config.tensor_model_parallel_size == 2 and not config.sequence_parallel


def test_moe_kernel_switches_reach_the_config():
    """--moe-permute-fusion / --moe-router-fusion select megatron.core.fusions' MoE kernels: kept, not reset."""
    args = validated(*MOE, "--moe-permute-fusion", "--moe-router-fusion")
    config = core_transformer_config_from_args(args)
    assert config.moe_permute_fusion and config.moe_router_fusion
    default = core_transformer_config_from_args(validated(*MOE))
    assert not default.moe_permute_fusion and not default.moe_router_fusion


@pytest.mark.parametrize(
    "balancing, z_loss, names",
    [
        ("aux_loss", None, ["load_balancing_loss"]),
        ("seq_aux_loss", 1e-3, ["load_balancing_loss", "seq_load_balancing_loss", "z_loss"]),
        (["seq_aux_loss", "global_aux_loss"], None, ["seq_load_balancing_loss", "global_load_balancing_loss"]),
        ("none", 1e-3, ["z_loss"]),
    ],
)
def test_logged_moe_losses_follow_megatron_lms_rule(balancing, z_loss, names):
    args = validated(*MOE)
    args.moe_router_load_balancing_type, args.moe_z_loss_coeff = balancing, z_loss
    assert moe_track_names(args) == names


def test_top1_probability_on_input_and_forced_balancing_reach_the_config():
    args = validated(
        "--num-experts",
        "4",
        "--moe-router-topk",
        "1",
        "--moe-apply-probs-on-input",
        "--moe-router-force-load-balancing",
    )
    config = core_transformer_config_from_args(args)
    assert config.moe_apply_probs_on_input and config.moe_router_force_load_balancing


class _RecordingWriter:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[(name, iteration)] = float(value)


def _logged_moe_losses():
    from megatron.core import num_microbatches_calculator as calculator
    from megatron.core.transformer.moe import moe_utils
    from megatron.training.moe_logging import track_moe_losses
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_model_parallel()
    calculator.unset_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(0, None, 8, 2, 1)  # 4 micro-batches per step
    args = validated(
        *MOE, "--num-layers", "4", "--moe-layer-freq", "2", "--moe-z-loss-coeff", "1e-3", "--moe-per-layer-logging"
    )
    # Four micro-batches recorded the losses of the two MoE layers (1 and 3, 1-based layer numbers).
    for _ in range(4):
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.5), 1, 4)
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), 3, 4)
        moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(2.0), 3, 4)
    writer, totals = _RecordingWriter(), {}
    track_moe_losses(args, 7, writer, None, totals)
    calculator.unset_num_microbatches_calculator()
    return {k: float(v) for k, v in totals.items()}, writer.scalars


def test_moe_losses_reach_the_loss_dict_and_tensorboard_per_layer():
    from tests.unit_tests.test_utilities import run_distributed

    totals, scalars = run_distributed(1, _logged_moe_losses)[0]
    # Per layer: the sum over micro-batches / 4 micro-batches; logged: the sum over layers / 2 MoE layers.
    assert totals == pytest.approx({"load_balancing_loss": 1.0, "z_loss": 1.0})
    assert scalars[("load_balancing_loss", 7)] == pytest.approx(1.0) and scalars[("z_loss", 7)] == pytest.approx(1.0)
    assert [scalars[(f"moe/load_balancing_loss_layer_{i}", 7)] for i in range(4)] == pytest.approx([1.5, 0, 0.5, 0])
