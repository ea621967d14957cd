"""Distributed-optimizer checkpoints across layouts: Megatron's and ours, saved at one data-parallel (and, for
fully_reshardable, tensor-parallel) size and resumed at another, continue training exactly as without the restart.

Every data-parallel rank trains on the same batch, so the gradients and hence the step after a resume do not depend
on the data-parallel size: the loss after one more step must match Megatron's own (the fixture's) at every layout.
"""

import pytest
import torch

from megatron.core import dist_checkpointing
from tests.unit_tests.dist_checkpointing.test_distrib_optimizer_layouts import (
    _expected,
    _load_fixture_and_step,
    batch_loss,
    build,
    load,
    model_space_state,
    train_step,
)
from tests.unit_tests.test_utilities import run_distributed

BUCKETS = {"dp_reshardable": 500, "dp_zero_gather_scatter": 500, "fully_reshardable": None}


def _save_ours(layout: str, tp: int, checkpoint: str):
    gpt, model, optimizer, model_args = build(tp, BUCKETS[layout])
    train_step(model, optimizer, model_args, seed=1)
    metadata = {"distrib_optim_sharding_type": layout, "singleton_local_shards": False}
    model_state = gpt.sharded_state_dict(metadata=metadata)
    state = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict({"model": model_state}, metadata=metadata),
        "iteration": 1,
    }
    dist_checkpointing.save(state, checkpoint, content_metadata=metadata)
    reference = model_space_state(gpt, optimizer) if tp == 1 else None
    train_step(model, optimizer, model_args, seed=2)
    with torch.no_grad():
        return reference, batch_loss(model, model_args, seed=3).item()


def _resume(layout: str, tp: int, checkpoint: str):
    gpt, model, optimizer, model_args = build(tp, BUCKETS[layout], seed=99)  # other weights: all must come from disk
    load(gpt, optimizer, checkpoint)
    state = model_space_state(gpt, optimizer) if tp == 1 else None
    train_step(model, optimizer, model_args, seed=2)
    with torch.no_grad():
        return state, batch_loss(model, model_args, seed=3).item()


@pytest.mark.parametrize(
    "layout, save_layout, load_layout",
    [
        ("dp_reshardable", (1, 2), (1, 1)),
        ("dp_reshardable", (1, 2), (1, 4)),
        ("dp_zero_gather_scatter", (1, 2), (1, 1)),
        ("dp_zero_gather_scatter", (1, 2), (1, 4)),
        ("fully_reshardable", (1, 2), (1, 1)),
        ("fully_reshardable", (1, 2), (1, 4)),
        ("fully_reshardable", (2, 2), (1, 2)),
    ],
)
def test_our_checkpoint_resumes_at_another_layout(tmp_path, layout, save_layout, load_layout):
    (save_tp, save_dp), (load_tp, load_dp) = save_layout, load_layout
    saved = run_distributed(save_tp * save_dp, _save_ours, layout, save_tp, str(tmp_path))
    resumed = run_distributed(load_tp * load_dp, _resume, layout, load_tp, str(tmp_path))
    reference_loss = saved[0][1]
    for state, loss in resumed:
        assert loss == pytest.approx(reference_loss, abs=1e-5 if save_tp == load_tp else 2e-3)
        if save_tp == load_tp:
            # fp32 main params and Adam's moments, element for element, at the new data-parallel size
            assert state.keys() == saved[0][0].keys()
            assert all(torch.equal(state[key], saved[0][0][key]) for key in state)


@pytest.mark.parametrize(
    "name", ["dp_reshardable_tp1_dp2", "dp_zero_gather_scatter_tp1_dp2", "fully_reshardable_tp1_dp2"]
)
@pytest.mark.parametrize("world", [1, 4])
def test_megatron_checkpoint_resumes_at_another_data_parallel_size(name, world):
    bucket_size = BUCKETS[name.rsplit("_tp", 1)[0]]
    for result in run_distributed(world, _load_fixture_and_step, name, 1, bucket_size):
        assert result["step"] == 1
        assert result["loss"] == pytest.approx(_expected(name)["loss_after_step_2"], abs=2e-3)


def test_megatron_fully_reshardable_checkpoint_resumes_at_another_tensor_parallel_size():
    name = "fully_reshardable_tp2_dp2"
    for result in run_distributed(2, _load_fixture_and_step, name, 1, None):
        assert result["loss"] == pytest.approx(_expected(name)["loss_after_step_2"], abs=2e-3)
