"""torch_dist checkpoints with Megatron FSDP: the wrapped model and optimizer give the same keys as DDP / the
distributed optimizer, so a run saved under FSDP resumes under DDP and the reverse, at another data-parallel size,
continuing with the same losses as the run that never stopped."""

import pytest
import torch

from megatron.core import dist_checkpointing
from tests.unit_tests.distributed import fsdp_test_helpers as fh
from tests.unit_tests.models import gpt_test_helpers as gpt
from tests.unit_tests.test_utilities import run_distributed

SAVE_AT, CONTINUE = 2, (2, 3)


def _build(layout, seed=1234):
    strategy, distributed = layout
    model = gpt.build_model(1, False, "gpt2", seed=seed)
    wrapped = fh.wrap(model, strategy, use_distributed_optimizer=distributed)
    return wrapped, fh.optimizer_for(wrapped)


def _state(wrapped, optimizer, metadata, is_loading=False):
    model_state = wrapped.sharded_state_dict(metadata=metadata)
    optimizer_state = optimizer.sharded_state_dict({"model": model_state}, is_loading=is_loading, metadata=metadata)
    return {"model": model_state, "optimizer": optimizer_state}


def _save(layout, sharding_type, checkpoint):
    wrapped, optimizer = _build(layout)
    for step in range(SAVE_AT):
        fh.train_step(wrapped, optimizer, step)
    metadata = {"distrib_optim_sharding_type": sharding_type, "singleton_local_shards": False}
    dist_checkpointing.save(_state(wrapped, optimizer, metadata), checkpoint, content_metadata=metadata)
    keys = sorted(_state(wrapped, optimizer, metadata)["model"])
    return keys, [fh.train_step(wrapped, optimizer, step) for step in CONTINUE]


def _resume(layout, checkpoint):
    wrapped, optimizer = _build(layout, seed=99)  # other weights: everything must come from the checkpoint
    metadata = dist_checkpointing.load_content_metadata(checkpoint)
    request = _state(wrapped, optimizer, metadata, is_loading=True)
    keys = sorted(request["model"])
    loaded = dist_checkpointing.load(request, checkpoint)
    wrapped.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    return keys, [fh.train_step(wrapped, optimizer, step) for step in CONTINUE]


DDP, DISTOPT = (None, False), (None, True)
ZERO3, ZERO2, ZERO1 = ("optim_grads_params", True), ("optim_grads", True), ("optim", True)


@pytest.mark.parametrize(
    "save_layout, save_dp, load_layout, load_dp, sharding_type",
    [
        (ZERO3, 2, DISTOPT, 4, "fully_reshardable"),
        (DISTOPT, 4, ZERO3, 2, "fully_reshardable"),
        (ZERO2, 2, ZERO3, 1, "fully_sharded_model_space"),
        (ZERO1, 4, ZERO2, 2, "fully_reshardable"),
        (ZERO3, 2, ZERO3, 2, "dp_reshardable"),
    ],
)
def test_fsdp_checkpoint_resumes_under_another_layout_and_dp_size(
    tmp_path, save_layout, save_dp, load_layout, load_dp, sharding_type
):
    saved = run_distributed(save_dp, _save, save_layout, sharding_type, str(tmp_path))
    resumed = run_distributed(load_dp, _resume, load_layout, str(tmp_path))
    saved_keys, expected_losses = saved[0]
    for keys, losses in resumed:
        assert keys == saved_keys, "FSDP's sharded state dict has the same keys as DDP's"
        assert losses == pytest.approx(expected_losses, rel=1e-5)


def test_fsdp_model_weights_load_into_plain_ddp(tmp_path):
    saved = run_distributed(2, _save, ZERO3, "fully_reshardable", str(tmp_path))
    weights = run_distributed(1, _weights_after_load, str(tmp_path))[0]
    reference = run_distributed(2, _weights_after_steps)[0]
    assert weights.keys() == reference.keys() and saved
    for name in weights:
        assert torch.equal(weights[name], reference[name]), name


def _weights_after_load(checkpoint):
    wrapped, _ = _build(DDP, seed=99)
    request = {"model": wrapped.sharded_state_dict()}
    wrapped.load_state_dict(dist_checkpointing.load(request, checkpoint)["model"])
    return fh.full_weights(wrapped)


def _weights_after_steps():
    wrapped, optimizer = _build(ZERO3)
    for step in range(SAVE_AT):
        fh.train_step(wrapped, optimizer, step)
    return fh.full_weights(wrapped)
