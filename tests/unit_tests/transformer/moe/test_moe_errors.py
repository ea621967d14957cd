"""The MoE modules' own errors (beyond the config's): each names what is wrong and what to do instead."""

import re

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import moe_utils
from tests.unit_tests.test_utilities import Utils, run_distributed
from tests.unit_tests.transformer.moe.moe_test_helpers import build_moe_layer, moe_config


def test_unsupported_arguments_are_refused():
    logits = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"precomputed_indices are not supported with moe_router_fusion"):
        moe_utils.topk_routing_with_score_function(logits, 1, fused=True, precomputed_indices=torch.zeros(4, 1).long())
    with pytest.raises(ValueError, match=r"expects \[tokens, experts\] logits, got \(2, 4, 3\)"):
        moe_utils.topk_routing_with_score_function(torch.randn(2, 4, 3), 1)
    with pytest.raises(ValueError, match=r"routing replay \(router_replay\) is not supported yet"):
        moe_utils.topk_routing_with_score_function(logits, 1, router_replay=object())
    with pytest.raises(ValueError, match=r"unpermute: probs need the routing_map they were selected with"):
        moe_utils.unpermute(torch.randn(2, 2), torch.tensor([0, 1]), torch.Size([2, 2]), probs=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"moe_token_drop_policy must be 'probs' or 'position', got 'random'"):
        moe_utils.apply_router_token_dropping(torch.rand(8, 2), torch.ones(8, 2, dtype=torch.bool), 1, 0.5, "random")
    with pytest.raises(ValueError, match=r"moe_router_score_function must be 'softmax', 'sigmoid' or 'sqrtsoftplus'"):
        moe_utils.compute_routing_scores_for_aux_loss(logits, 1, "tanh")


def _module_errors():
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import InferenceTopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    Utils.initialize_model_parallel(1)
    config = moe_config()
    messages = []
    for build in (
        lambda: MoELayer(config),
        lambda: MoEFlexTokenDispatcher(4, [0, 1, 2, 3], config),
        lambda: InferenceTopKRouter(moe_config(moe_router_num_groups=2, moe_router_group_topk=1)),
        lambda: build_moe_layer(config)(torch.randn(8, 2, 16), intermediate_tensors=(torch.ones(1),)),
    ):
        try:
            build()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_module_errors():
    messages = run_distributed(1, _module_errors)[0]
    patterns = [
        r"MoELayer needs submodules \(MoESubmodules with at least the experts\)",
        r"not supported yet: moe_token_dispatcher_type='flex' \(DeepEP / HybridEP kernels\); use 'alltoall'",
        r"InferenceTopKRouter needs moe_router_num_groups=None, got 2; use TopKRouter",
        r"MoELayer: intermediate_tensors \(partial CUDA-graph capture\) is not supported",
    ]
    for message, pattern in zip(messages, patterns):
        assert message is not None and re.search(pattern, message), (pattern, message)


def _mismatched_groups():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    Utils.initialize_model_parallel(1, expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    groups = parallel_state.get_process_group_collection()
    # A hand-made collection with the expert-parallel and expert-tensor-parallel groups swapped.
    swapped = ProcessGroupCollection(ep=groups.expt_tp, expt_tp=groups.ep, tp_ep=groups.tp_ep)
    try:
        MoEAlltoAllTokenDispatcher(2, [0, 1], moe_config(ep=2, etp=2), pg_collection=swapped)
    except ValueError as error:
        return str(error)
    return None


def test_expert_groups_that_do_not_nest_are_refused_before_any_communication():
    for message in run_distributed(4, _mismatched_groups):
        assert message is not None and "the expert groups do not nest" in message


def _completed_partial_collection():
    from megatron.core.transformer.moe.moe_layer import _complete_pg_collection

    Utils.initialize_model_parallel(1, expert_model_parallel_size=2)
    defaults = parallel_state.get_process_group_collection()
    mine = dist.new_group([0, 1])
    # Unset groups read as None (Megatron 0.19); the MoE layer fills those from parallel_state, keeps the given ones.
    completed = _complete_pg_collection(ProcessGroupCollection(ep=mine, pp=defaults.pp))
    return (
        completed.ep is mine,
        completed.pp is defaults.pp,
        all(getattr(completed, name) is getattr(defaults, name) for name in ("tp", "cp", "expt_tp", "expt_dp")),
        completed.dp is None,  # only the MoE groups are completed
    )


def test_partial_collection_is_completed_from_parallel_state():
    for result in run_distributed(2, _completed_partial_collection):
        assert result == (True, True, True, True)
