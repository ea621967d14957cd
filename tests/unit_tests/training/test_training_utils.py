"""megatron.training.utils: Megatron's package layout, masks and positions, rank-aware printing, reductions over
groups, memory and profiling helpers, the progress log, ADLR autoresume."""

import types
import warnings

import pytest
import torch

from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.training import global_vars
from megatron.training import utils as training_utils
from megatron.training.utils import (
    append_to_progress_log,
    get_device_arch_version,
    get_local_rank_preinit,
    get_ltor_masks_and_position_ids,
    get_nvtx_range,
    has_nvrx_checkpointing_async_support,
    has_nvrx_installed,
    is_hybrid_model,
    is_rank0,
    print_rank_0,
    to_empty_if_meta_device,
    update_use_dist_ckpt,
    warn_rank_0,
)
from tests.unit_tests.test_utilities import run_distributed


def test_package_layout_is_megatrons():
    """Megatron-LM 0.19's utils is a package; its names come from these submodules."""
    modules = {
        name: getattr(training_utils, name).__module__
        for name in ("print_rank_0", "report_memory", "append_to_progress_log", "start_memory_history_recording")
    }
    assert modules == {
        "print_rank_0": "megatron.training.utils.common_utils",
        "report_memory": "megatron.training.utils.common_utils",
        "append_to_progress_log": "megatron.training.utils.log_utils",
        "start_memory_history_recording": "megatron.training.utils.utils",
    }


def test_ltor_masks_match_the_dataset_per_sample_and_batch_the_mask_only_when_it_differs():
    eod, pad = 0, 7
    data = torch.tensor([[5, 3, 0, 4, 4, 0, 2, 7], [1, 2, 3, 4, 0, 9, 7, 7]])
    mask, loss_mask, positions = get_ltor_masks_and_position_ids(data, eod, pad, True, True, True, True)
    assert mask.shape == (2, 1, 8, 8) and loss_mask.shape == (2, 8) and positions.shape == (2, 8)
    for row in range(2):
        ref_mask, ref_loss, ref_positions = _get_ltor_masks_and_position_ids(data[row], eod, True, True, True, True)
        ref_loss[data[row] == pad] = 0.0
        assert torch.equal(mask[row], ref_mask) and torch.equal(positions[row], ref_positions)
        assert torch.equal(loss_mask[row], ref_loss)
    assert positions[0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert loss_mask[1].tolist() == [1, 1, 1, 1, 0, 1, 0, 0]

    mask, loss_mask, positions = get_ltor_masks_and_position_ids(data, eod, pad, False, False, False, False)
    assert mask.shape == (1, 1, 8, 8)  # one causal mask serves the whole batch
    assert torch.equal(mask[0, 0], torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1))
    assert bool(loss_mask.all()) and positions[1].tolist() == list(range(8))


def test_printing_and_warning_before_distributed_init(capsys):
    assert is_rank0()
    print_rank_0("hello")
    assert capsys.readouterr().out == "hello\n"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_rank_0("careful")
    assert [str(w.message) for w in caught] == ["careful"]


def test_local_rank_before_init_reads_torchrun_then_slurm_then_warns(monkeypatch):
    for name in ("LOCAL_RANK", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(UserWarning, match="Defaulting to local rank 0"):
        assert get_local_rank_preinit() == 0
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert get_local_rank_preinit() == 3
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert get_local_rank_preinit() == 5


def test_to_empty_if_meta_device_allocates_only_meta_tensors():
    with torch.device("meta"):
        meta_layer = torch.nn.Linear(3, 2)
    real_layer = torch.nn.Linear(3, 2)
    weight = real_layer.weight.detach().clone()
    meta_layer.register_buffer("scale", torch.ones(2))  # a real buffer next to meta parameters
    to_empty_if_meta_device(meta_layer, device=torch.device("cpu"))
    to_empty_if_meta_device(real_layer, device=torch.device("cpu"))
    assert not meta_layer.weight.is_meta and meta_layer.weight.shape == (2, 3)
    assert torch.equal(meta_layer.scale, torch.ones(2))
    assert torch.equal(real_layer.weight, weight)


def test_small_predicates():
    args = types.SimpleNamespace(ckpt_format="torch_dist")
    update_use_dist_ckpt(args)
    assert args.use_dist_ckpt
    args.ckpt_format = "torch"
    update_use_dist_ckpt(args)
    assert not args.use_dist_ckpt
    assert is_hybrid_model(types.SimpleNamespace(hybrid_layer_pattern="M*M*"))
    assert not is_hybrid_model(types.SimpleNamespace(is_hybrid_model=False, hybrid_layer_pattern=None))
    assert get_device_arch_version() == (0 if not torch.cuda.is_available() else torch.cuda.get_device_capability()[0])
    assert has_nvrx_installed() is False and has_nvrx_checkpointing_async_support() is False


def test_nvtx_range_names_a_region_in_the_profiler_trace():
    nvtx_range = get_nvtx_range()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with nvtx_range("my-region"):
            torch.ones(4).sum()
    assert "my-region" in {event.name for event in prof.events()}


def test_progress_log_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    append_to_progress_log(str(tmp_path), "Starting job")
    append_to_progress_log(str(tmp_path), "Saved checkpoint\tIteration: 5")
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    fields = [line.split("\t") for line in lines]
    assert [f[1:] for f in fields] == [
        ["Job ID: 4711", "# GPUs: 1", "Starting job"],
        ["Job ID: 4711", "# GPUs: 1", "Saved checkpoint", "Iteration: 5"],
    ]
    append_to_progress_log(None, "ignored")  # nothing to write to without --save


def test_start_memory_history_recording_on_cpu_warns_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("records for real on CUDA")
    with pytest.warns(UserWarning, match="records allocation history for CUDA memory only"):
        assert training_utils.start_memory_history_recording() is False


# ---- on several ranks -------------------------------------------------------------------------------------------


def _reductions():
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training.utils import (
        average_losses_across_data_parallel_group,
        logical_and_across_model_parallel_group,
        reduce_max_stat_across_model_parallel_group,
    )

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)  # 4 ranks: TP2 x DP2
    rank = dist.get_rank()
    averaged = average_losses_across_data_parallel_group([torch.tensor(float(rank)), torch.tensor(10.0 * rank)])
    stat = reduce_max_stat_across_model_parallel_group(float(rank) if rank % 2 else None)
    nobody = reduce_max_stat_across_model_parallel_group(None)
    all_true = logical_and_across_model_parallel_group(True)
    one_false = logical_and_across_model_parallel_group(rank != 2)
    return averaged.tolist(), stat, nobody, all_true, one_false


def test_reductions_over_data_and_model_parallel_groups():
    results = run_distributed(4, _reductions)
    # DP groups: {0, 2} and {1, 3}; model-parallel (TP) groups: {0, 1} and {2, 3}.
    assert [r[0] for r in results] == [[1.0, 10.0], [2.0, 20.0], [1.0, 10.0], [2.0, 20.0]]
    assert [r[1] for r in results] == [1.0, 1.0, 3.0, 3.0]
    assert [r[2] for r in results] == [None] * 4
    assert [r[3] for r in results] == [True] * 4
    assert [r[4] for r in results] == [True, True, False, False]


def _dtensor_norm():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megatron.training.utils import calc_dtensor_params_l2_norm

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(12, dtype=torch.float32).view(4, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    replicated = distribute_tensor(torch.full((2,), 2.0), mesh, [Replicate()])
    return calc_dtensor_params_l2_norm([sharded, replicated])


def test_dtensor_params_norm_counts_every_element_once():
    expected = torch.cat([torch.arange(12.0), torch.full((2,), 2.0)]).norm().item()
    assert run_distributed(2, _dtensor_norm) == [pytest.approx(expected)] * 2


def _report_memory_and_print_params():
    import io
    from contextlib import redirect_stdout

    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training.utils import print_params_min_max_norm, report_memory

    parallel_state.initialize_model_parallel()  # DP2: only data-parallel rank 0 reports memory
    out = io.StringIO()
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -2.0], [3.0, 4.0]]))
        layer.bias.zero_()
    optimizer = types.SimpleNamespace(param_groups=[{"params": [layer.weight, layer.bias]}])
    with redirect_stdout(out):
        line = report_memory("step 1")
        print_params_min_max_norm(optimizer, 7)
    return dist.get_rank(), line, out.getvalue()


def test_report_memory_prints_on_data_parallel_rank_0_and_params_lines():
    results = run_distributed(2, _report_memory_and_print_params)
    for rank, line, printed in results:
        assert line.startswith(f"[Rank {rank}] (after step 1) memory (MB) | ")
        assert (line in printed) == (rank == 0)
        assert f"      7, {rank:4d},    1,  0, -2.000000E+00, 4.000000E+00, {30**0.5:.6E}" in printed


class _FakeAutoResume:
    def __init__(self, requested):
        self.requested, self.resume_requested = requested, False

    def termination_requested(self):
        return self.requested

    def request_resume(self):
        self.resume_requested = True


def _autoresume(requested):
    from megatron.training.utils import check_adlr_autoresume_termination

    autoresume = _FakeAutoResume(requested)
    global_vars._GLOBAL_ADLR_AUTORESUME = autoresume
    global_vars._GLOBAL_ARGS = types.SimpleNamespace(save=None, num_floating_point_operations_so_far=0)
    try:
        check_adlr_autoresume_termination(3, None, None, None)
        return "continued", autoresume.resume_requested
    except SystemExit as stop:
        return f"exit {stop.code}", autoresume.resume_requested
    finally:
        global_vars.unset_global_variables()


def test_adlr_autoresume_termination_requests_a_resume_and_exits():
    assert run_distributed(1, _autoresume, False) == [("continued", False)]
    assert run_distributed(1, _autoresume, True) == [("exit 0", True)]
