"""Checkpoints with Megatron FSDP. torch_dist: the wrapped model and optimizer give the same keys as DDP / the
distributed optimizer, so a run saved under FSDP resumes under DDP and the reverse, at another data-parallel size,
continuing with the same losses as the run that never stopped. fsdp_dtensor (Megatron-LM's format for FSDP): the
same, between sharding strategies, data-parallel and tensor-parallel sizes, with Megatron-LM's key names."""

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


# ---- fsdp_dtensor: Megatron-LM's DCP layout for Megatron FSDP ----------------------------------------------------


def _fsdp_dtensor_build(strategy, tp, seed=1234):
    import argparse

    wrapped = fh.wrap(gpt.build_model(tp, False, "llama", seed=seed), strategy)  # llama: SwiGLU's fused fc1
    return wrapped, fh.optimizer_for(wrapped), argparse.Namespace(no_save_optim=False)


def _fsdp_dtensor_save(strategy, tp, checkpoint):
    from megatron.training.dcp_checkpointing import save_dcp_checkpoint
    from megatron.training.fsdp_dtensor_checkpointing import fsdp_dtensor_state_dict

    wrapped, optimizer, args = _fsdp_dtensor_build(strategy, tp)
    for step in range(SAVE_AT):
        fh.train_step(wrapped, optimizer, step)
    save_dcp_checkpoint(fsdp_dtensor_state_dict(args, [wrapped], optimizer, None, None, iteration=SAVE_AT), checkpoint)
    return [fh.train_step(wrapped, optimizer, step) for step in CONTINUE]


def _fsdp_dtensor_resume(strategy, tp, checkpoint):
    from megatron.training import fsdp_dtensor_checkpointing as fdc
    from megatron.training.dcp_checkpointing import load_dcp_checkpoint, stored_keys

    wrapped, optimizer, args = _fsdp_dtensor_build(strategy, tp, seed=99)  # everything must come from the checkpoint
    stored = stored_keys(checkpoint)
    template = fdc.fsdp_dtensor_template(args, stored, [wrapped], optimizer, None, None, True)
    loaded = load_dcp_checkpoint(template, checkpoint)
    fdc.load_optimizer_entries(optimizer, loaded["optimizer"])
    fdc.publish_main_params(optimizer)
    return sorted(stored), loaded["iteration"], [fh.train_step(wrapped, optimizer, step) for step in CONTINUE]


@pytest.mark.parametrize(
    "save, load",
    [((ZERO3[0], 2, 1), (ZERO1[0], 4, 1)), ((ZERO2[0], 2, 2), (ZERO3[0], 1, 1))],
    ids=["zero3_dp2-zero1_dp4", "zero2_tp2_dp1-zero3_dp1"],
)
def test_fsdp_dtensor_checkpoint_resumes_at_another_data_and_tensor_parallel_size(tmp_path, save, load):
    (save_strategy, save_ranks, save_tp), (load_strategy, load_ranks, load_tp) = save, load
    expected = run_distributed(save_ranks, _fsdp_dtensor_save, save_strategy, save_tp, str(tmp_path))[0]
    resumed = run_distributed(load_ranks, _fsdp_dtensor_resume, load_strategy, load_tp, str(tmp_path))
    for keys, iteration, losses in resumed:
        assert iteration == SAVE_AT
        assert losses == pytest.approx(expected, rel=1e-5)
    # Megatron-LM's names: SwiGLU's fc1 as its two halves, the optimizer's entries by parameter name.
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    assert {f"model.module.{fc1}_w", f"model.module.{fc1}_v"} <= set(keys) and f"model.module.{fc1}" not in keys
    for name in ("exp_avg", "exp_avg_sq", "step"):
        assert f"optimizer.state.module.module.{fc1}_v.{name}" in keys
    assert f"optimizer.param_to_group_meta.module.module.{fc1}.lr" in keys


def _adam_state_total(optimizer):
    """The sum of every |exp_avg| and |exp_avg_sq| element over all ranks (each element lives on one rank when TP is
    1): the same number at every layout."""
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64)
    for member in optimizer.chained_optimizers:
        for state in member.optimizer.state.values():
            total += sum(state[name].double().abs().sum() for name in ("exp_avg", "exp_avg_sq"))
    dist.all_reduce(total)
    return total.item()


def _moe_fsdp_dtensor(ep, checkpoint, save):
    import argparse

    from megatron.training import fsdp_dtensor_checkpointing as fdc
    from megatron.training.dcp_checkpointing import load_dcp_checkpoint, save_dcp_checkpoint, stored_keys
    from tests.unit_tests.distributed.test_megatron_fsdp import _moe_model

    wrapped = fh.wrap(_moe_model(ep), "optim_grads_params")
    optimizer, args = fh.optimizer_for(wrapped), argparse.Namespace(no_save_optim=False)
    if save:
        for step in range(SAVE_AT):
            fh.train_step(wrapped, optimizer, step)
        save_dcp_checkpoint(fdc.fsdp_dtensor_state_dict(args, [wrapped], optimizer, None, None), checkpoint)
        state = _adam_state_total(optimizer)
    else:
        for member in optimizer.chained_optimizers:  # the weights (fp32: the main shards) must come from the checkpoint
            for _, main_param, _ in member.fsdp_dtensor_main_params():
                main_param.data.zero_()
        stored = stored_keys(checkpoint)
        template = fdc.fsdp_dtensor_template(args, stored, [wrapped], optimizer, None, None, True)
        loaded = load_dcp_checkpoint(template, checkpoint)
        fdc.load_optimizer_entries(optimizer, loaded["optimizer"])
        fdc.publish_main_params(optimizer)
        state = _adam_state_total(optimizer)
    return state, [fh.train_step(wrapped, optimizer, step) for step in CONTINUE]


def test_fsdp_dtensor_with_expert_parallelism_resumes_at_another_expert_parallel_size(tmp_path):
    # Saved at EP2 (experts sharded over expert-DP 2, dense parameters over DP 4), resumed at EP1 x DP2: expert
    # entries carry the global expert index.
    expected_state, expected = run_distributed(4, _moe_fsdp_dtensor, 2, str(tmp_path), True)[0]
    for state, losses in run_distributed(2, _moe_fsdp_dtensor, 1, str(tmp_path), False):
        assert state == pytest.approx(expected_state, rel=1e-9)  # every Adam moment arrived
        assert losses[0] == pytest.approx(expected[0], rel=1e-6)  # the weights did
        # Then EP1 reduces the expert gradients in another order than EP2; Adam (lr 1e-2) turns those 1e-7
        # differences into ~1e-5 of the next loss (a same-layout resume is exact).
        assert losses[1] == pytest.approx(expected[1], rel=2e-4)
