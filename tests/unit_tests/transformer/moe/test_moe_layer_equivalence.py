"""MoELayer at EP / ETP / TP x EP layouts equals the single-process layer over the same global batch: the output of
every rank's tokens, the aux-loss and z-loss values as logged, and every gradient (router, shared experts, each
expert by its global index) after the data-parallel / expert-data-parallel reductions DDP performs."""

import functools

import pytest
import torch

from megatron.core import parallel_state
from tests.unit_tests.models.gpt_test_helpers import relative_error
from tests.unit_tests.test_utilities import Utils, run_distributed
from tests.unit_tests.transformer.moe.moe_test_helpers import (
    build_moe_layer,
    fresh_moe_state,
    global_batch,
    moe_config,
    reduced_tracker,
    summed_full_gradients,
)

TOLERANCE = 1e-5


def _reference(overrides: dict, num_batches: int):
    Utils.initialize_model_parallel(1)
    fresh_moe_state()
    layer = build_moe_layer(moe_config(**overrides))
    inputs, weights = global_batch(num_batches)
    if overrides.get("moe_router_load_balancing_type") == "global_aux_loss":
        # The global-batch loss counts expert loads over all data-parallel ranks: one process sees them as one batch.
        inputs, weights, num_batches = [torch.cat(inputs, dim=1)], [torch.cat(weights, dim=1)], 1
    outputs = []
    for x, w in zip(inputs, weights):
        output, bias = layer(x.clone().requires_grad_())
        assert bias is None
        (output * w).sum().backward()
        outputs.append(output.detach())
    grads = {name: param.grad.clone() for name, param in layer.named_parameters()}
    # One process saw every data-parallel batch: the logged value is the mean over them.
    tracker = {name: values / num_batches for name, values in reduced_tracker().items()}
    return outputs, grads, tracker


@functools.lru_cache(maxsize=None)
def reference(overrides_items: tuple, num_batches: int):
    return run_distributed(1, _reference, dict(overrides_items), num_batches)[0]


def _parallel(tp: int, ep: int, etp: int, overrides: dict, num_batches: int):
    Utils.initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    fresh_moe_state()
    layer = build_moe_layer(moe_config(tp, ep, etp, **overrides))
    dp_rank = parallel_state.get_data_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    inputs, weights = global_batch(num_batches)
    x, w = inputs[dp_rank].chunk(tp)[tp_rank], weights[dp_rank].chunk(tp)[tp_rank]
    output, _ = layer(x.clone().requires_grad_())
    (output * w).sum().backward()
    for name, param in layer.named_parameters():
        # Expert weights are reduced over the expert data-parallel group; router and shared experts over DP.
        assert getattr(param, "allreduce", True) == (not name.startswith("experts.")), name
        if name.startswith("experts."):
            assert not getattr(param, "sequence_parallel", False), name
    assert layer.router.weight.sequence_parallel == (tp > 1)
    return dict(
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        output=output.detach(),
        grads=summed_full_gradients(layer),
        tracker=reduced_tracker(),
        recomputes=layer.moe_layer_recompute,
    )


LAYOUTS = [
    # world, tp, ep, etp, dispatcher, extra config
    (2, 1, 2, 1, "allgather", {}),
    (2, 1, 2, 1, "alltoall", {}),
    (4, 1, 4, 1, "allgather", {}),
    (4, 1, 4, 1, "alltoall", {}),
    (2, 1, 1, 2, "allgather", {}),
    (2, 1, 1, 2, "alltoall", {}),
    (4, 2, 2, 2, "allgather", {}),
    (4, 2, 2, 2, "alltoall", {}),
    (4, 2, 2, 1, "alltoall", {}),
    (4, 2, 2, 2, "alltoall", {"moe_grouped_gemm": True}),
    (2, 1, 1, 2, "allgather", {"add_bias_linear": True, "moe_grouped_gemm": True}),
    (2, 1, 2, 1, "alltoall", {"add_bias_linear": True}),
    (
        2,
        1,
        2,
        1,
        "alltoall",
        {
            "moe_router_load_balancing_type": "sinkhorn",
            "moe_aux_loss_coeff": 0.0,
            "moe_router_topk_scaling_factor": 2.0,
            "moe_router_dtype": "fp32",
        },
    ),
    # z-loss off: it is a per-batch mean, which the concatenated reference batch would halve.
    (4, 2, 2, 2, "alltoall", {"moe_router_load_balancing_type": "global_aux_loss", "moe_z_loss_coeff": None}),
    (
        2,
        1,
        2,
        1,
        "alltoall",
        {
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_load_balancing_type": "seq_aux_loss",
            "moe_router_num_groups": 2,
            "moe_router_group_topk": 1,
        },
    ),
]


@pytest.mark.parametrize(
    "world,tp,ep,etp,dispatcher,extra",
    LAYOUTS,
    ids=[f"tp{t}-ep{e}-etp{x}-{d}{'-' + '-'.join(k) if k else ''}" for _, t, e, x, d, k in LAYOUTS],
)
def test_moe_layer_matches_single_process(world, tp, ep, etp, dispatcher, extra):
    overrides = {"moe_token_dispatcher_type": dispatcher, **extra}
    num_batches = world // tp
    ref_outputs, ref_grads, ref_tracker = reference(tuple(sorted(overrides.items())), num_batches)
    for result in run_distributed(world, _parallel, tp, ep, etp, overrides, num_batches):
        if len(ref_outputs) == 1 and num_batches > 1:  # one concatenated batch: this rank's columns of it
            expected = ref_outputs[0].chunk(num_batches, dim=1)[result["dp_rank"]].chunk(tp)[result["tp_rank"]]
        else:
            expected = ref_outputs[result["dp_rank"]].chunk(tp)[result["tp_rank"]]
        assert relative_error(result["output"], expected) <= TOLERANCE
        assert result["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            error = relative_error(result["grads"][name], grad)
            assert error <= TOLERANCE, f"{name}: relative error {error:.2e}"
        assert result["tracker"].keys() == ref_tracker.keys() and ref_tracker
        for name, values in ref_tracker.items():
            assert relative_error(result["tracker"][name], values) <= TOLERANCE, name


@pytest.mark.parametrize("policy,pad", [("probs", False), ("position", True)])
def test_capacity_and_token_dropping_match_single_process(policy, pad):
    overrides = {
        "moe_token_dispatcher_type": "alltoall",
        "moe_expert_capacity_factor": 0.5,
        "moe_token_drop_policy": policy,
        "moe_pad_expert_input_to_capacity": pad,
    }
    ref_outputs, ref_grads, _ = reference(tuple(sorted(overrides.items())), 2)
    for result in run_distributed(2, _parallel, 1, 2, 1, overrides, 2):
        assert relative_error(result["output"], ref_outputs[result["dp_rank"]]) <= TOLERANCE
        for name, grad in ref_grads.items():
            assert relative_error(result["grads"][name], grad) <= TOLERANCE, name


def test_grouped_gemm_experts_equal_sequential_mlp():
    base = {"moe_token_dispatcher_type": "alltoall"}
    seq_outputs, seq_grads, _ = reference(tuple(sorted(base.items())), 1)
    grouped = {**base, "moe_grouped_gemm": True}
    out_outputs, out_grads, _ = reference(tuple(sorted(grouped.items())), 1)
    assert relative_error(out_outputs[0], seq_outputs[0]) <= TOLERANCE
    for e in range(4):
        for fc in ("linear_fc1", "linear_fc2"):
            sequential = seq_grads[f"experts.local_experts.{e}.{fc}.weight"]
            assert relative_error(out_grads[f"experts.{fc}.weight{e}"], sequential) <= TOLERANCE
    assert relative_error(out_grads["router.weight"], seq_grads["router.weight"]) <= TOLERANCE


def test_grouped_matmul_paths_agree():
    from megatron.core.transformer.moe.grouped_linear import grouped_matmul

    generator = torch.Generator().manual_seed(0)
    counts = [3, 0, 5]
    x = torch.randn(8, 16, generator=generator, requires_grad=True)
    weights = [torch.randn(8, 16, generator=generator, requires_grad=True) for _ in counts]
    expected = torch.cat([block @ w.t() for block, w in zip(torch.split(x, counts), weights)])
    aligned = grouped_matmul(x, weights, counts)  # 16-byte rows: torch._grouped_mm where the build has it
    assert torch.allclose(aligned, expected, atol=1e-5)
    odd_x = x[:, :15]
    odd = grouped_matmul(odd_x, [w[:, :15] for w in weights], counts)  # unaligned: the padded batched matmul
    assert torch.allclose(
        odd, torch.cat([b @ w[:, :15].t() for b, w in zip(torch.split(odd_x, counts), weights)]), atol=1e-5
    )
    aligned.pow(2).sum().backward()
    assert x.grad is not None and all(w.grad is not None for w in weights)


@pytest.mark.parametrize(
    "recompute",
    [{"moe_layer_recompute": True}, {"recompute_granularity": "selective", "recompute_modules": ["moe"]}],
    ids=["moe_layer_recompute", "recompute_modules"],
)
def test_moe_layer_recompute_gives_the_same_output_losses_and_gradients(recompute):
    base = {"moe_token_dispatcher_type": "alltoall"}
    ref_outputs, ref_grads, ref_tracker = reference(tuple(sorted(base.items())), 2)
    for result in run_distributed(2, _parallel, 1, 2, 1, {**base, **recompute}, 2):
        assert result["recomputes"] is True
        assert relative_error(result["output"], ref_outputs[result["dp_rank"]]) <= TOLERANCE
        for name, grad in ref_grads.items():
            assert relative_error(result["grads"][name], grad) <= TOLERANCE, name
        for name, values in ref_tracker.items():  # the losses are attached once, in the recomputation
            assert relative_error(result["tracker"][name], values) <= TOLERANCE, name


def _padding(valid_only: bool):
    Utils.initialize_model_parallel(1)
    fresh_moe_state()
    layer = build_moe_layer(moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True))
    (x,), _ = global_batch(1)
    padding = torch.zeros(x.shape[1], x.shape[0], dtype=torch.bool)  # [b, s], True = padding
    padding[1, 5:] = True
    if valid_only:
        output, _ = layer(torch.cat([x[:, 0], x[:5, 1]]).unsqueeze(1))
    else:
        output, _ = layer(x, padding_mask=padding)
    output.sum().backward()
    return reduced_tracker(), layer.router.local_tokens_per_expert.clone()


def test_padding_tokens_are_left_out_of_the_losses_and_the_expert_counts():
    ((padded_tracker, padded_counts),) = run_distributed(1, _padding, False)
    ((valid_tracker, valid_counts),) = run_distributed(1, _padding, True)
    assert torch.equal(padded_counts, valid_counts) and padded_counts.sum() == 13 * 2
    for name in ("load_balancing_loss", "z_loss"):
        assert relative_error(padded_tracker[name], valid_tracker[name]) <= TOLERANCE, name
