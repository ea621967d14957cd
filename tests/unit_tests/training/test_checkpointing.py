"""megatron.training.checkpointing: Megatron's names and helpers, and a training checkpoint's round trip with the
entries Megatron's carry (rerun_state_machine, content_metadata), release and non-persistent saves."""

import os
import types

import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingException
from megatron.training import checkpointing, global_vars
from megatron.training.checkpointing import (
    CheckpointType,
    check_checkpoint_args,
    checkpoint_exists,
    cleanup_old_non_persistent_checkpoint,
    ensure_directory_exists,
    finalize_deletion_processes,
    find_checkpoint_rank_0,
    fix_query_key_value_ordering,
    get_checkpoint_name,
    get_distributed_optimizer_checkpoint_name,
    get_load_checkpoint_path_by_args,
    write_tracker_atomically,
)
from tests.unit_tests.test_utilities import run_distributed
from tests.unit_tests.training.test_arguments import validated


def test_legacy_per_rank_names():
    assert get_checkpoint_name("/c", 3) == "/c/iter_0000003/mp_rank_00/model_optim_rng.pt"
    assert get_checkpoint_name("/c", 3, pipeline_parallel=True, tensor_rank=1, pipeline_rank=2) == (
        "/c/iter_0000003/mp_rank_01_002/model_optim_rng.pt"
    )
    assert get_checkpoint_name("/c", 3, True, True, 1, 2, True, 4, basename="x.pt") == (
        "/c/release/mp_rank_01_002_004/x.pt"
    )
    assert get_distributed_optimizer_checkpoint_name("/c/iter_0000003/mp_rank_00/model_optim_rng.pt") == (
        "/c/iter_0000003/mp_rank_00/distrib_optim.pt"
    )
    assert [member.name for member in CheckpointType] == ["LEGACY", "LOCAL", "GLOBAL", "TORCH_DCP", "FSDP_DTENSOR"]


def test_directories_trackers_and_load_path(tmp_path):
    ensure_directory_exists(str(tmp_path / "a" / "b" / "file.pt"))
    ensure_directory_exists(str(tmp_path / "c"), check_parent=False)
    assert (tmp_path / "a" / "b").is_dir() and (tmp_path / "c").is_dir()
    load, pretrained = tmp_path / "load", tmp_path / "pretrained"
    load.mkdir(), pretrained.mkdir()
    args = types.SimpleNamespace(load=str(load), pretrained_checkpoint=str(pretrained))
    assert not checkpoint_exists(str(load)) and not checkpoint_exists(None)
    assert get_load_checkpoint_path_by_args(args) == str(load)  # nothing anywhere: the flag's directory
    write_tracker_atomically(pretrained, 4)
    assert get_load_checkpoint_path_by_args(args) == str(pretrained)
    write_tracker_atomically(load, 9)
    assert get_load_checkpoint_path_by_args(args) == str(load)
    assert find_checkpoint_rank_0(str(load), 9) is None  # tracked, but no complete checkpoint


@pytest.mark.parametrize("do_async", [False, True])
def test_cleanup_keeps_the_newest_non_persistent_checkpoints(tmp_path, do_async):
    for iteration in (5, 10, 100, 20):
        (tmp_path / f"iter_{iteration:07d}").mkdir()
    cleanup_old_non_persistent_checkpoint(tmp_path, leave_ckpt_num=2, do_async=do_async)
    finalize_deletion_processes(blocking=True)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000020", "iter_0000100"]


def test_check_checkpoint_args_names_what_differs(monkeypatch):
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", types.SimpleNamespace(num_layers=4, hidden_size=64))
    check_checkpoint_args(types.SimpleNamespace(num_layers=4, hidden_size=64, unrelated=1))
    with pytest.raises(
        CheckpointingException, match="saved for another model: hidden_size: checkpoint 32, this run 64"
    ):
        check_checkpoint_args(types.SimpleNamespace(num_layers=4, hidden_size=32))
    check_checkpoint_args(types.SimpleNamespace(num_layers=4, hidden_size=32), skip_args={"hidden_size"})


def test_versions():
    fix_query_key_value_ordering(None, 3.0)
    with pytest.raises(CheckpointingException, match="not supported yet: checkpoints of version 1.0"):
        fix_query_key_value_ordering(None, 1.0)
    previous = checkpointing.get_checkpoint_version()
    try:
        checkpointing._CHECKPOINT_VERSION = None
        checkpointing.set_checkpoint_version(3.0)
        checkpointing.set_checkpoint_version(3.0)
        with pytest.raises(CheckpointingException, match="checkpoint versions do not match: 3.0 .* now 2.0"):
            checkpointing.set_checkpoint_version(2.0)
    finally:
        checkpointing._CHECKPOINT_VERSION = previous


# ---- a training checkpoint on two ranks ------------------------------------------------------------------------


def _setup(root, seed, *extra):
    from megatron.core.enums import ModelType
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer
    import pretrain_gpt

    args = validated(
        "--tensor-model-parallel-size",
        2,
        "--save",
        root,
        "--seed",
        seed,
        "--save-interval",
        10,
        "--use-distributed-optimizer",
        *extra,
        world_size=2,
    )
    args.rank = torch.distributed.get_rank()
    global_vars.set_args(args)
    initialize_megatron()
    return setup_model_and_optimizer(ModelType.encoder_or_decoder, pretrain_gpt.model_provider)


def _train_one_step(model, optimizer, scheduler):
    """One real step (so the optimizer has state to save), through train_step's Megatron signature."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.training import train_step
    from megatron.training.utils import unwrap_model
    import pretrain_gpt

    config = unwrap_model(model[0]).config
    config.finalize_model_grads_func = finalize_model_grads
    generator = torch.Generator().manual_seed(0)

    def batches():
        while True:
            tokens = torch.randint(0, 100, (2, 33), generator=generator)
            yield {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "loss_mask": torch.ones(2, 32),
                "position_ids": torch.arange(32).repeat(2, 1),
            }

    losses, skipped, _, _ = train_step(
        pretrain_gpt.forward_step,
        batches(),
        model,
        optimizer,
        scheduler,
        config,
        get_forward_backward_func(),
        iteration=0,
    )
    assert skipped == 0 and "lm loss" in losses and model[0].iteration == 1


def _weights(model):
    return {name: param.detach().clone() for name, param in model[0].named_parameters()}


def _round_trip(root):
    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.core.rerun_state_machine import RerunMode, destroy_rerun_state_machine, get_rerun_state_machine

    destroy_rerun_state_machine()
    try:
        model, optimizer, scheduler = _setup(root, 1)
        _train_one_step(model, optimizer, scheduler)
        machine = get_rerun_state_machine()
        for _ in range(3):  # three steps: current_iteration 2
            while machine.should_run_forward_backward(None):
                pass
        saved = _weights(model)
        context = {}
        checkpointing.save_checkpoint(7, model, optimizer, scheduler, 1234.0, checkpointing_context=context)
        strategy_kept = context["save_strategy"] is not None
        common = load_common_state_dict(os.path.join(root, "iter_0000007"))
        global_vars.unset_global_variables()

        model, optimizer, scheduler = _setup(root, 2)  # another seed: other weights until loaded
        different_before = any(not torch.equal(saved[n], p) for n, p in _weights(model).items())
        loaded = []
        get_rerun_state_machine().load_state_dict = loaded.append
        iteration, flops = checkpointing.load_checkpoint(model, optimizer, scheduler, load_arg="save")
        same_after = all(torch.equal(saved[n], p) for n, p in _weights(model).items())
        return (
            strategy_kept,
            common["rerun_state_machine"] == {"mode": RerunMode.DISABLED},
            common["content_metadata"],
            different_before,
            same_after,
            iteration,
            flops,
            loaded[0]["mode"],
            loaded[0]["sharded"]["current_iteration"],
            checkpointing.get_loaded_iteration(),
            checkpointing.get_checkpoint_version(),
        )
    finally:
        global_vars.unset_global_variables()
        destroy_rerun_state_machine()


def test_round_trip_carries_rerun_state_machine_and_content_metadata(tmp_path):
    from megatron.core.rerun_state_machine import RerunMode

    results = run_distributed(2, _round_trip, str(tmp_path))
    metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "distrib_optim_sharding_type": "dp_reshardable",
    }
    assert results == [(True, True, metadata, True, True, 7, 1234.0, RerunMode.DISABLED, 2, 7, 3.0)] * 2


def _release_non_persistent_and_skip_load(root):
    try:
        model, optimizer, scheduler = _setup(root, 1)
        _train_one_step(model, optimizer, scheduler)
        saved = _weights(model)
        checkpointing.save_checkpoint(3, model, optimizer, scheduler, 0, release=True)
        for iteration in (4, 5):
            checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 0, non_persistent_ckpt=True)
        global_vars.unset_global_variables()
        model, optimizer, scheduler = _setup(root, 2)
        calls = []
        model[0].load_state_dict = lambda *a, **k: calls.append("model")
        optimizer.load_state_dict = lambda *a, **k: calls.append("optimizer")
        # The tensors are read in place either way; skipping leaves out the modules' own load_state_dict.
        iteration, _ = checkpointing.load_checkpoint(
            model, optimizer, scheduler, load_arg="save", skip_load_to_model_and_opt=True
        )
        untouched = calls == []
        del model[0].load_state_dict, optimizer.load_state_dict
        iteration_again, _ = checkpointing.load_checkpoint(model, optimizer, scheduler, load_arg="save")
        loaded = all(torch.equal(saved[n], p) for n, p in _weights(model).items())
        return iteration, untouched, iteration_again, loaded
    finally:
        global_vars.unset_global_variables()


def test_release_and_non_persistent_saves_and_skip_load(tmp_path):
    # A release checkpoint loads as iteration 0 (and never restores optimizer or RNG state).
    assert run_distributed(2, _release_non_persistent_and_skip_load, str(tmp_path)) == [(0, True, 0, True)] * 2
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    non_persistent = tmp_path / "non_persistent"
    assert sorted(p for p in os.listdir(non_persistent) if p.startswith("iter_")) == ["iter_0000005"]
    assert (non_persistent / "latest_checkpointed_iteration.txt").read_text() == "5"


class _StatefulLoader:
    def __init__(self):
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.position += 1
        return self.position

    def save_state(self):
        return {"position": self.position}


def _save_dataloader_state(root):
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import RerunDataIterator

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)  # 4 ranks: TP2 x DP2
    iterator = RerunDataIterator(_StatefulLoader())
    next(iterator)
    checkpointing.maybe_save_dataloader_state(iterator, 12, root)
    checkpointing.maybe_save_dataloader_state(None, 12, root)  # nothing to save
    try:
        checkpointing.maybe_save_dataloader_state(iter([1]), 12, root)
    except RuntimeError as error:
        return str(error)


def test_dataloader_state_one_file_per_data_parallel_rank(tmp_path):
    errors = run_distributed(4, _save_dataloader_state, str(tmp_path))
    assert all("has no iterable.save_state() to save" in error for error in errors)
    directory = tmp_path / "iter_0000012"
    assert sorted(os.listdir(directory)) == ["train_dataloader_dprank000.pt", "train_dataloader_dprank001.pt"]
    state = torch.load(directory / "train_dataloader_dprank001.pt", weights_only=True)
    assert state == {"dataloader_state_dict": {"position": 1}}


def _load_errors(root):
    """A checkpoint saved with --no-save-optim, then resumed without and with --no-load-optim."""
    try:
        model, optimizer, scheduler = _setup(root, 1, "--no-save-optim")
        _train_one_step(model, optimizer, scheduler)
        checkpointing.save_checkpoint(3, model, optimizer, scheduler, 0)
        global_vars.unset_global_variables()
        model, optimizer, scheduler = _setup(root, 2)
        try:
            checkpointing.load_checkpoint(model, optimizer, scheduler, load_arg="save")
            missing_optimizer = None
        except checkpointing.CheckpointingException as error:
            missing_optimizer = str(error)
        global_vars.unset_global_variables()
        model, optimizer, scheduler = _setup(root, 2, "--no-load-optim")
        iteration, _ = checkpointing.load_checkpoint(model, optimizer, scheduler, load_arg="save")
        return missing_optimizer, iteration
    finally:
        global_vars.unset_global_variables()


def _local_names(weights):
    """Weights by the local spec's parameter names (the Transformer Engine layout keeps the norms in the linears)."""
    renames = {
        "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
        "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
    }
    renamed = {}
    for name, value in weights.items():
        for fused, separate in renames.items():
            name = name.replace(fused, separate)
        renamed[name] = value
    return renamed


def _resume_in_the_other_layout(root, save_impl, load_impl):
    from megatron.core.transformer.te_layout import TELayoutLayerNormColumnParallelLinear
    from megatron.training.utils import unwrap_model

    def te_layout(model):
        layer = unwrap_model(model[0]).decoder.layers[0]
        return isinstance(layer.self_attention.linear_qkv, TELayoutLayerNormColumnParallelLinear)

    try:
        # The parameter order in the buckets differs between the two layouts: only model space carries over.
        model, optimizer, scheduler = _setup(
            root, 1, "--transformer-impl", save_impl, "--dist-ckpt-optim-fully-reshardable"
        )
        saved_layout = te_layout(model)
        _train_one_step(model, optimizer, scheduler)
        saved = _local_names(_weights(model))
        checkpointing.save_checkpoint(5, model, optimizer, scheduler, 0)
        global_vars.unset_global_variables()
        model, optimizer, scheduler = _setup(root, 2, "--transformer-impl", load_impl)
        loaded_layout = te_layout(model)
        iteration, _ = checkpointing.load_checkpoint(model, optimizer, scheduler, load_arg="save")
        weights = _local_names(_weights(model))
        same = weights.keys() == saved.keys() and all(torch.equal(saved[n], weights[n]) for n in saved)
        return saved_layout, loaded_layout, iteration, same
    finally:
        global_vars.unset_global_variables()


def test_a_checkpoint_without_optimizer_state_needs_no_load_optim(tmp_path):
    for missing_optimizer, iteration in run_distributed(2, _load_errors, str(tmp_path)):
        assert "holds no optimizer state (it was saved with --no-save-optim); pass --no-load-optim" in (
            missing_optimizer
        )
        assert iteration == 3  # with --no-load-optim the weights load


def test_a_bucket_space_optimizer_layout_is_refused_at_another_model_layout():
    from argparse import Namespace

    saved = Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, transformer_impl="local")
    here = Namespace(use_distributed_optimizer=True, transformer_impl="transformer_engine")
    assert checkpointing._bucket_layout_changes(saved, saved, 2, 1) == []
    changes = checkpointing._bucket_layout_changes(saved, here, 1, 1)
    assert changes == ["--tensor-model-parallel-size 2 -> 1", "--transformer-impl local -> transformer_engine"]
    for layout in ("dp_reshardable", "dp_zero_gather_scatter"):
        metadata = {"distrib_optim_sharding_type": layout}
        checkpointing._check_optimizer_layout(here, metadata, [], "ckpt/iter_0000010")  # same layout: fine
        with pytest.raises(checkpointing.CheckpointingException) as error:
            checkpointing._check_optimizer_layout(here, metadata, changes, "ckpt/iter_0000010")
        assert f"ckpt/iter_0000010: its distributed-optimizer state is in the {layout} layout" in str(error.value)
        assert "(--tensor-model-parallel-size 2 -> 1; --transformer-impl local -> transformer_engine)" in str(
            error.value
        )
        assert "--dist-ckpt-optim-fully-reshardable" in str(error.value) and "--no-load-optim" in str(error.value)
    for layout in ("fully_reshardable", "fully_sharded_model_space"):
        checkpointing._check_optimizer_layout(here, {"distrib_optim_sharding_type": layout}, changes, "ckpt")
