"""Every MoE config rule raises one ValueError naming the field and the fix, when the config is built."""

import warnings

import pytest

from megatron.core.transformer.transformer_config import TransformerConfig

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2)

ERRORS = [
    (dict(num_moe_experts=0), r"num_moe_experts must be a positive integer, got 0"),
    (dict(moe_router_topk=5), r"moe_router_topk=5 is larger than num_moe_experts=4"),
    (dict(expert_model_parallel_size=3), r"num_moe_experts=4 is not divisible by expert_model_parallel_size=3"),
    (
        dict(moe_expert_capacity_factor=1.0),
        r"moe_expert_capacity_factor=1.0 needs moe_token_dispatcher_type="
        r"'alltoall' \(the 'allgather' dispatcher is dropless\)",
    ),
    (
        dict(moe_pad_expert_input_to_capacity=True),
        r"moe_pad_expert_input_to_capacity=True needs "
        r"moe_expert_capacity_factor",
    ),
    (
        dict(moe_expert_capacity_factor=-1.0, moe_token_dispatcher_type="alltoall"),
        r"moe_expert_capacity_factor must be positive",
    ),
    (
        dict(
            moe_expert_capacity_factor=1.0,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="sinkhorn",
        ),
        r"moe_expert_capacity_factor works with the aux_loss",
    ),
    (dict(moe_token_drop_policy="random"), r"moe_token_drop_policy='random' must be 'probs' or 'position'"),
    (dict(moe_token_dispatcher_type="flex"), r"not supported yet: moe_token_dispatcher_type='flex'"),
    (dict(moe_token_dispatcher_type="ring"), r"moe_token_dispatcher_type='ring' is not one of"),
    (dict(moe_router_load_balancing_type="balanced"), r"moe_router_load_balancing_type 'balanced' is not one of"),
    (
        dict(moe_router_load_balancing_type="quantile_balancing"),
        r"not supported yet: moe_router_load_balancing_type="
        r"'quantile_balancing'",
    ),
    (
        dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01),
        r"'sinkhorn' balances without an aux loss, but moe_aux_loss_coeff=0.01",
    ),
    (
        dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"], moe_aux_loss_coeff=0.01),
        r"lists 2 types .* moe_aux_loss_coeff must be a list of 2 coefficients",
    ),
    (dict(moe_aux_loss_coeff=[0.1, 0.2]), r"moe_aux_loss_coeff=\[0.1, 0.2\] is a list but"),
    (dict(moe_aux_loss_coeff=-0.1), r"moe_aux_loss_coeff must be >= 0"),
    (dict(moe_router_score_function="tanh"), r"moe_router_score_function='tanh' is not one of"),
    (dict(moe_router_dtype="bf16"), r"moe_router_dtype='bf16' must be None, 'fp32' or 'fp64'"),
    (
        dict(moe_router_enable_expert_bias=True),
        r"moe_router_enable_expert_bias=True needs "
        r"moe_router_score_function='sigmoid'",
    ),
    (dict(moe_input_jitter_eps=0.0), r"moe_input_jitter_eps must be positive"),
    (dict(moe_router_topk_scaling_factor=-1.0), r"moe_router_topk_scaling_factor must be positive"),
    (dict(moe_z_loss_coeff=-1.0), r"moe_z_loss_coeff must be >= 0"),
    (dict(moe_router_bias_update_rate=-1.0), r"moe_router_bias_update_rate must be >= 0"),
    (dict(moe_router_num_groups=2), r"group-limited routing needs both"),
    (
        dict(moe_router_num_groups=3, moe_router_group_topk=1),
        r"num_moe_experts=4 is not divisible by "
        r"moe_router_num_groups=3",
    ),
    (dict(moe_router_num_groups=2, moe_router_group_topk=3), r"moe_router_group_topk=3 is larger than"),
    (
        dict(moe_router_topk=3, moe_router_num_groups=2, moe_router_group_topk=2),
        r"moe_router_topk=3 must be a "
        r"multiple of moe_router_group_topk=2",
    ),
    (
        dict(moe_router_topk_limited_devices=1, moe_router_num_groups=2, moe_router_group_topk=1),
        r"moe_router_topk_limited_devices \(deprecated\) cannot be combined",
    ),
    (dict(moe_layer_freq=0), r"moe_layer_freq must be >= 1"),
    (
        dict(moe_layer_freq=[1, 2]),
        r"moe_layer_freq=\[1, 2\] must list 0 \(dense\) or 1 \(MoE\) for each of the "
        r"num_layers=2",
    ),
    (dict(moe_layer_freq="1"), r"moe_layer_freq must be an int or a list"),
    (dict(moe_apply_probs_on_input=True), r"moe_apply_probs_on_input=True needs moe_router_topk=1"),
    (
        dict(moe_ffn_hidden_size=30, expert_tensor_parallel_size=4, expert_model_parallel_size=1),
        r"moe_ffn_hidden_size=30 is not divisible by expert_tensor_parallel_size=4",
    ),
    (dict(moe_shared_expert_intermediate_size=0), r"moe_shared_expert_intermediate_size must be a positive"),
    (
        dict(moe_shared_expert_gate=True),
        r"moe_shared_expert_gate / moe_shared_expert_overlap need "
        r"moe_shared_expert_intermediate_size",
    ),
    (
        dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True),
        r"moe_shared_expert_overlap=True .* needs moe_token_dispatcher_type='alltoall'",
    ),
    (dict(num_moe_experts=None, expert_model_parallel_size=2), r"expert_model_parallel_size=2 needs num_moe_experts"),
    (
        dict(num_moe_experts=None, moe_shared_expert_intermediate_size=8),
        r"moe_shared_expert_intermediate_size is set "
        r"but num_moe_experts is None",
    ),
]


@pytest.mark.parametrize("overrides,message", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_each_inconsistent_moe_setting_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**BASE, **overrides})


def test_defaults_are_derived_as_megatron_does():
    config = TransformerConfig(
        **BASE, ffn_hidden_size=48, expert_model_parallel_size=2, moe_router_topk_limited_devices=1
    )
    assert config.moe_ffn_hidden_size == 48
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)


def test_valid_moe_settings_build():
    TransformerConfig(
        **BASE,
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        moe_aux_loss_coeff=[0.01, 0.001],
        moe_layer_freq=[1, 0],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=1.25,
        moe_pad_expert_input_to_capacity=True,
        moe_shared_expert_intermediate_size=32,
        moe_shared_expert_overlap=True,
        moe_router_dtype="fp32",
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
    )


def test_tensor_parallelism_without_sequence_parallelism_builds_with_megatrons_warning():
    """Megatron builds an MoE config at TP > 1 without sequence parallelism (MoELayer refuses only its training
    forward); with expert parallelism too it warns that training needs sequence parallelism."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = TransformerConfig(**BASE, tensor_model_parallel_size=2)
    assert not config.sequence_parallel
    with pytest.warns(UserWarning, match=r"set sequence_parallel=True \(--sequence-parallel\) for training"):
        TransformerConfig(**BASE, tensor_model_parallel_size=2, expert_model_parallel_size=2)
