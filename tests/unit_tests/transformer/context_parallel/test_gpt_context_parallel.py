"""GPTModel from the local spec at CP > 1 trains like the single process.

Every rank first runs the CP=1 model (same seed, same batch) for the reference, then rebuilds the model at the
layout under test, feeds it its ``get_batch_on_this_cp_rank`` split of the batch, and checks that the loss summed
over the CP group and every parameter's gradient summed over the CP group (and gathered over TP) equal the
reference's, fp32. Each layout runs every cp_comm_type that fits it in one call, so workers start once per layout.
"""

import pytest
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.utils import get_batch_on_this_cp_rank
from tests.unit_tests.models.gpt_test_helpers import (
    SEQ,
    VARIANTS,
    VOCAB,
    assert_close_dicts,
    batch,
    build_config,
    full_gradients,
)
from tests.unit_tests.test_utilities import run_distributed

TOLERANCE = 1e-5


def _loss_and_grads(tp, sp, cp, variant, comm_type=None, hierarchical=None, extra=None):
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, hierarchical_context_parallel_sizes=hierarchical
    )
    model_parallel_cuda_manual_seed(1234)
    spec = VARIANTS[variant]
    overrides = {
        **spec["config"],
        "context_parallel_size": cp,
        "cp_comm_type": comm_type,
        "hierarchical_context_parallel_sizes": hierarchical,
        **(extra or {}),
    }
    config = build_config(tp, sp, overrides)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ, **spec["model"])
    core = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert all((c.context_parallel is not None) == (cp > 1) for c in core), "the local spec must pick CP attention"
    tokens, position_ids, labels = batch()
    data = get_batch_on_this_cp_rank(
        {"tokens": tokens, "position_ids": position_ids, "labels": labels}, is_hybrid_cp=False
    )
    loss = model(data["tokens"], data["position_ids"], None, labels=data["labels"]).sum()
    loss.backward()
    cp_group = parallel_state.get_context_parallel_group()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    grads = full_gradients(model)
    for grad in grads.values():
        dist.all_reduce(grad, group=cp_group)
    return total, grads


def _compare_layouts(tp, sp, cp, variant, comm_types, extra=None):
    expected_loss, expected_grads = _loss_and_grads(1, False, 1, variant)
    for comm_type, hierarchical in comm_types:
        loss, grads = _loss_and_grads(tp, sp, cp, variant, comm_type, hierarchical, extra)
        what = f"tp={tp} sp={sp} cp={cp} {variant} {comm_type}"
        assert abs(loss - expected_loss) <= TOLERANCE * abs(expected_loss), f"{what}: loss {loss} vs {expected_loss}"
        assert_close_dicts(grads, expected_grads, TOLERANCE, what)
    return True


ALL_CP4 = [("p2p", None), ("all_gather", None), ("a2a", None), ("a2a+p2p", [2, 2])]


@pytest.mark.parametrize(
    "world, tp, sp, cp, variant, comm_types",
    [
        pytest.param(2, 1, False, 2, "gpt2", [("p2p", None), ("all_gather", None), ("a2a", None)], id="cp2-gpt2"),
        pytest.param(4, 1, False, 4, "gpt2", ALL_CP4, id="cp4-gpt2"),
        pytest.param(4, 1, False, 4, "llama", ALL_CP4, id="cp4-llama"),
        pytest.param(4, 2, False, 2, "gpt2", [("p2p", None), ("a2a", None)], id="tp2-cp2-gpt2"),
        pytest.param(
            4, 2, True, 2, "llama", [("p2p", None), ("all_gather", None), ("a2a", None)], id="tp2-sp-cp2-llama"
        ),
    ],
)
def test_gpt_at_context_parallel_layout_matches_one_process(world, tp, sp, cp, variant, comm_types):
    assert all(run_distributed(world, _compare_layouts, tp, sp, cp, variant, comm_types))


def _with_recomputation():
    # Full-layer recomputation re-runs the ring attention's forward inside backward.
    extra = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return _compare_layouts(1, False, 2, "gpt2", [("p2p", None)], extra)


def test_context_parallel_with_activation_recomputation():
    assert all(run_distributed(2, _with_recomputation))


def _per_layer_comm_types():
    # One communication type per layer (Megatron's list form): layer 1 rings, layer 2 all-to-alls.
    return _compare_layouts(1, False, 2, "llama", [(["p2p", "a2a"], None)])


def test_one_comm_type_per_layer():
    assert all(run_distributed(2, _per_layer_comm_types))
