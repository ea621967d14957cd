"""Megatron-LM's other checkpoint formats: legacy ``torch`` (per-rank model_optim_rng.pt) and ``torch_dcp`` saved
and loaded through the training API, a legacy checkpoint written by Megatron-LM itself, format detection, the
offline conversion (--ckpt-convert-format), and damaged or hostile legacy files."""

import os
from pathlib import Path
import shutil
import types

import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.dist_checkpointing.checkpoint_dir import checkpoint_format
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.training import checkpointing, global_vars
from megatron.training.legacy_checkpointing import load_legacy_state_dict
from megatron.training.plain_checkpointing import format_to_load
from tests.unit_tests.test_utilities import REPO_ROOT, run_distributed
from tests.unit_tests.training.test_arguments import parse, validated
from tests.unit_tests.training.test_checkpointing import _weights

FIXTURE = os.path.join(REPO_ROOT, "tests/unit_tests/dist_checkpointing/data/megatron_legacy_torch")


def _setup(seed, *extra, world_size=2):
    from megatron.core.enums import ModelType
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer
    import pretrain_gpt

    args = validated("--seed", seed, *extra, world_size=world_size)
    args.rank = torch.distributed.get_rank()
    global_vars.set_args(args)
    initialize_megatron()
    return setup_model_and_optimizer(ModelType.encoder_or_decoder, pretrain_gpt.model_provider)


def _step(model, optimizer, scheduler):
    """One training step on a fixed batch; its loss on the last pipeline stage (None on the others)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.training import train_step
    from megatron.training.utils import unwrap_model
    import pretrain_gpt

    config = unwrap_model(model[0]).config
    config.finalize_model_grads_func = finalize_model_grads
    tokens = torch.randint(0, 100, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(2, 32),
        "position_ids": torch.arange(32).repeat(2, 1),
    }
    batches = iter([batch] * 100)
    step = (pretrain_gpt.forward_step, batches, model, optimizer, scheduler, config, get_forward_backward_func())
    losses, skipped, _, _ = train_step(*step, iteration=0)
    assert skipped == 0
    return torch.as_tensor(losses["lm loss"]).tolist() if "lm loss" in losses else None


# ---- save, resume, same next step ------------------------------------------------------------------------------


def _resume(root, ckpt_format, layout):
    """Train a step, save at iteration 7, train another: the same second step (loss and updated weights) after
    resuming in a fresh job initialised with another seed."""
    try:
        save_flags = ("--save", root, "--save-interval", 10, "--ckpt-format", ckpt_format, *layout)
        model, optimizer, scheduler = _setup(1, *save_flags)
        _step(model, optimizer, scheduler)
        checkpointing.save_checkpoint(7, model, optimizer, scheduler, 99.0)
        saved = _weights(model)
        expected = _step(model, optimizer, scheduler)
        stepped = _weights(model)  # the optimizer's state (Adam's moments, step, learning rate) shows here
        global_vars.unset_global_variables()

        # The default --ckpt-format torch_dist detects the format, as in Megatron-LM.
        model, optimizer, scheduler = _setup(2, "--load", root, *layout)
        args = global_vars.get_args()
        iteration, flops = args.iteration, args.num_floating_point_operations_so_far
        loaded_same = all(torch.equal(saved[n], p) for n, p in _weights(model).items())
        same_loss = _step(model, optimizer, scheduler) == expected
        same_step = all(torch.equal(stepped[n], p) for n, p in _weights(model).items())
        return iteration, flops, loaded_same, same_loss, same_step
    finally:
        global_vars.unset_global_variables()


@pytest.mark.parametrize(
    "ckpt_format, layout, files",
    [
        ("torch", ("--tensor-model-parallel-size", 2), ["mp_rank_00", "mp_rank_01"]),
        ("torch", ("--pipeline-model-parallel-size", 2), ["mp_rank_00_000", "mp_rank_00_001"]),
        ("torch", ("--use-distributed-optimizer",), ["mp_rank_00"]),  # data-parallel 2: one file of each kind
        ("torch_dcp", (), [".metadata", "__0_0.distcp", "__1_0.distcp"]),
    ],
)
def test_save_and_resume_gives_the_same_next_step(tmp_path, ckpt_format, layout, files):
    results = run_distributed(2, _resume, str(tmp_path), ckpt_format, layout)
    assert results == [(7, 99.0, True, True, True)] * 2
    assert sorted(os.listdir(tmp_path / "iter_0000007")) == sorted(files + ["checksums"])
    # Every file of the checkpoint has its checksum record.
    written = {p.relative_to(tmp_path / "iter_0000007") for p in (tmp_path / "iter_0000007").rglob("*") if p.is_file()}
    data_files = {p for p in written if p.parts[0] != "checksums"}
    assert {p.relative_to("checksums") for p in written - data_files} == {Path(f"{p}.json") for p in data_files}
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert checkpoint_format(tmp_path / "iter_0000007") == ckpt_format
    if ckpt_format == "torch":
        state = safe_torch_load(str(tmp_path / "iter_0000007" / files[-1] / "model_optim_rng.pt"), "test")
        assert state["iteration"] == 7 and state["checkpoint_version"] == 3.0
        assert {"model", "optimizer", "opt_param_scheduler", "rng_state", "args"} <= set(state)
        assert isinstance(state["rng_state"], list) and "num_floating_point_operations_so_far" in state
    if "--use-distributed-optimizer" in layout:
        # As in Megatron-LM: beside the model file only the data-parallel-independent optimizer state, the parameter
        # state (fp32 main parameters, Adam's moments) in distrib_optim.pt.
        assert sorted(os.listdir(tmp_path / "iter_0000007" / "mp_rank_00")) == [
            "distrib_optim.pt",
            "model_optim_rng.pt",
        ]
        assert set(state["optimizer"]) == {"optimizer"} and set(state["optimizer"]["optimizer"]) == {"param_groups"}
        assert {group["step"] for group in state["optimizer"]["optimizer"]["param_groups"]} == {1}


def _save_and_step(root, *layout):
    """Train a step, save a legacy checkpoint at iteration 7, train another: (weights saved, the second step's loss,
    the weights after it)."""
    try:
        model, optimizer, scheduler = _setup(
            1, "--save", root, "--save-interval", 10, "--ckpt-format", "torch", *layout
        )
        _step(model, optimizer, scheduler)
        checkpointing.save_checkpoint(7, model, optimizer, scheduler, 99.0)
        saved = _weights(model)
        return saved, _step(model, optimizer, scheduler), _weights(model)
    finally:
        global_vars.unset_global_variables()


def _load_and_step(root, *layout):
    """Resume from ``root`` in a job with another seed: (iteration, weights loaded, the distributed optimizer's
    parameter state gathered on data-parallel rank 0, the next step's loss, the weights after it)."""
    try:
        model, optimizer, scheduler = _setup(2, "--load", root, *layout, world_size=torch.distributed.get_world_size())
        loaded, parameter_state = _weights(model), optimizer.get_parameter_state_dp_zero()
        loss = _step(model, optimizer, scheduler)
        return global_vars.get_args().iteration, loaded, parameter_state, loss, _weights(model)
    finally:
        global_vars.unset_global_variables()


def _same(first, second) -> bool:
    return first.keys() == second.keys() and all(
        torch.equal(torch.as_tensor(first[name]), torch.as_tensor(second[name])) for name in first
    )


def test_a_legacy_distributed_optimizer_checkpoint_resumes_at_another_data_parallel_size(tmp_path):
    # distrib_optim.pt holds padding-free world tensors, independent of the data-parallel size (as in Megatron-LM).
    # The same global batch: one micro-batch per rank at size 2, two of the same batch at size 1 (without dropout,
    # whose masks differ between those micro-batches).
    distopt = ("--use-distributed-optimizer", "--global-batch-size", 4, "--hidden-dropout", 0, "--attention-dropout", 0)
    (saved, expected_loss, stepped), _ = run_distributed(2, _save_and_step, str(tmp_path), *distopt)
    iteration, loaded, parameter_state, loss, after = run_distributed(1, _load_and_step, str(tmp_path), *distopt)[0]
    assert iteration == 7 and _same(loaded, saved)
    # The fp32 main parameters and Adam's moments, scattered at data-parallel size 1, are those saved at size 2.
    stored = safe_torch_load(str(tmp_path / "iter_0000007" / "mp_rank_00" / "distrib_optim.pt"), "test")
    assert parameter_state.keys() == stored.keys() and all(
        _same(parameter_state[index][dtypes], stored[index][dtypes])
        for index in range(len(stored) - 1)  # the buffers, beside the 'buckets_coalesced' flag
        for dtypes in stored[index]
    )
    assert sorted(stored[0][next(iter(stored[0]))]) == ["exp_avg", "exp_avg_sq", "numel_unpadded", "param"]
    assert loss == expected_loss and _same(after, stepped)


# ---- a legacy checkpoint written by Megatron-LM ------------------------------------------------------------------


def _load_megatron_fixture(root):
    try:
        fixture_model = ["--num-layers", 2, "--hidden-size", 16, "--num-attention-heads", 4, "--seq-length", 8]
        fixture_model += [
            "--max-position-embeddings",
            8,
            "--vocab-size",
            31,
            "--make-vocab-size-divisible-by",
            1,
        ]  # +1: eod
        flags = (*fixture_model, "--untie-embeddings-and-output-weights", "--use-checkpoint-opt_param-scheduler")
        model, optimizer, _ = _setup(5, "--load", root, "--ckpt-format", "torch", *flags, world_size=1)
        args = global_vars.get_args()
        saved = safe_torch_load(os.path.join(root, "iter_0000001/mp_rank_00/model_optim_rng.pt"), "the fixture")
        mine = model[0].state_dict()
        same_weights = all(torch.equal(mine[name], saved["model"][name]) for name in mine if "_extra_state" not in name)
        adam = optimizer.optimizer.state_dict()["state"]
        same_moments = all(
            torch.equal(adam[i]["exp_avg"], saved["optimizer"]["state"][i]["exp_avg"])
            for i in saved["optimizer"]["state"]
        )
        return args.iteration, args.num_floating_point_operations_so_far, same_weights, same_moments, len(adam)
    finally:
        global_vars.unset_global_variables()


def test_a_legacy_checkpoint_written_by_megatron_lm_loads(tmp_path):
    # Written by tools/checkpoint/make_megatron_legacy_fixture.py with Megatron-LM 0.19's own save_checkpoint.
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    iteration, flops, same_weights, same_moments, states = run_distributed(
        1, _load_megatron_fixture, str(tmp_path / "ckpt")
    )[0]
    assert (iteration, flops, same_weights, same_moments) == (1, 123.0, True, True) and states > 0


# ---- which format a directory holds ------------------------------------------------------------------------------


def _args(ckpt_format, auto_detect=False):
    return types.SimpleNamespace(ckpt_format=ckpt_format, auto_detect_ckpt_format=auto_detect)


def test_format_detection_and_a_format_other_than_the_flag(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "legacy")
    legacy = str(tmp_path / "legacy" / "iter_0000001")
    assert checkpoint_format(legacy) == "torch" and checkpoint_format(tmp_path) is None
    # --ckpt-format torch_dist (the default) detects, as in Megatron-LM; so does --auto-detect-ckpt-format.
    assert format_to_load(_args("torch_dist"), legacy) == "torch"
    assert format_to_load(_args("torch_dcp", auto_detect=True), legacy) == "torch"
    assert format_to_load(_args("torch"), legacy) == "torch"
    with pytest.raises(CheckpointingException, match="is in the torch format, but --ckpt-format is torch_dcp; pass "):
        format_to_load(_args("torch_dcp"), legacy)
    assert checkpointing.find_checkpoint_rank_0(str(tmp_path / "legacy"), 1) == os.path.join(
        legacy, "mp_rank_00", "model_optim_rng.pt"
    )


# ---- damaged and hostile legacy files ----------------------------------------------------------------------------


def test_a_truncated_legacy_file_is_one_clear_error_naming_it(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CheckpointingException, match=f"legacy checkpoint file {path} is corrupt or truncated"):
        load_legacy_state_dict(str(tmp_path / "ckpt" / "iter_0000001"), 1, False)
    os.remove(path)
    with pytest.raises(CheckpointingException, match=f"has no {path} for this rank"):
        load_legacy_state_dict(str(tmp_path / "ckpt" / "iter_0000001"), 1, False)


class _Payload:
    """Unpickling this would run a command (it must never be unpickled)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_legacy_file_with_a_class_outside_the_allow_list_is_refused_unrun(tmp_path):
    path = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"model": {}, "args": _Payload(marker)}, path)
    with pytest.raises(CheckpointingException, match=r"holds an object of .*system, which is not in the allow-list"):
        load_legacy_state_dict(str(tmp_path / "iter_0000001"), 1, False)
    assert not marker.exists()


# ---- offline conversion ----------------------------------------------------------------------------------------


def _convert(root):
    """torch_dist -> torch -> torch_dist with --ckpt-convert-format: every checkpoint loads the same weights."""
    tp2 = ("--tensor-model-parallel-size", 2)
    try:
        model, optimizer, scheduler = _setup(1, "--save", f"{root}/orig", "--save-interval", 10, *tp2)
        _step(model, optimizer, scheduler)
        checkpointing.save_checkpoint(3, model, optimizer, scheduler, 42.0)
        saved = _weights(model)
        results = []
        for seed, load, target in ((2, "orig", "torch"), (3, "conv/torch", "torch_dist")):
            global_vars.unset_global_variables()
            convert = ("--ckpt-convert-format", target, "--ckpt-convert-save", f"{root}/conv")
            with pytest.raises(SystemExit) as exit_info:
                _setup(seed, "--load", f"{root}/{load}", "--auto-detect-ckpt-format", *convert, *tp2)
            results.append(exit_info.value.code in (0, None))
            global_vars.unset_global_variables()
            model, _, _ = _setup(seed + 10, "--load", f"{root}/conv/{target}", "--ckpt-format", target, *tp2)
            args = global_vars.get_args()
            same = all(torch.equal(saved[n], p) for n, p in _weights(model).items())
            results.append((args.iteration, args.num_floating_point_operations_so_far, same))
        return results
    finally:
        global_vars.unset_global_variables()


def test_ckpt_convert_format_round_trip(tmp_path):
    converted = [True, (3, 42.0, True)]
    assert run_distributed(2, _convert, str(tmp_path)) == [converted * 2] * 2
    assert checkpoint_format(tmp_path / "conv" / "torch" / "iter_0000003") == "torch"
    assert checkpoint_format(tmp_path / "conv" / "torch_dist" / "iter_0000003") == "torch_dist"


# ---- what the formats refuse -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, world_size, match",
    [
        (("--ckpt-format", "torch_dcp", "--tensor-model-parallel-size", 2), 2, "which --tensor-model-parallel-size 2"),
        (("--ckpt-format", "torch_dcp", "--use-distributed-optimizer"), 1, "which --use-distributed-optimizer would"),
        (("--ckpt-format", "torch", "--async-save"), 1, "--async-save writes torch_dist checkpoints; not supported"),
        (("--ckpt-convert-format", "torch"), 1, "--ckpt-convert-format needs --load"),
    ],
)
def test_refused_settings(flags, world_size, match):
    with pytest.raises(ValueError, match=match):
        validated(*flags, world_size=world_size)


def test_use_checkpoint_args_reads_a_legacy_checkpoint(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    args = parse("--load", tmp_path / "ckpt", "--use-checkpoint-args")
    checkpointing.load_args_from_checkpoint(args)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 16, 4)
