"""megatron.training.checkpointing.save_grads: gradient dumps in Megatron-LM's per-rank file layout, written once
per expert-data-parallel replica."""

import os
from collections import defaultdict

import pytest
import torch

from megatron.training.checkpointing import save_grads
from tests.unit_tests.test_utilities import Utils, run_distributed


def _dump(save_dir: str, pipeline: int, experts: int):
    Utils.initialize_model_parallel(1, pipeline, expert_model_parallel_size=experts)
    rank = torch.distributed.get_rank()
    grads = defaultdict(dict)
    grads["model_chunk0"]["layer.weight"] = torch.full((2, 2), float(rank))
    save_grads(save_dir, grads, 100, "wgrads")
    torch.distributed.barrier()
    return sorted(os.listdir(os.path.join(save_dir, "wgrads", "iter_0000100")))


@pytest.mark.parametrize(
    "pipeline, experts, files",
    [
        (1, 1, ["mp_rank_00.pth"]),  # two data-parallel replicas: the first writes
        (2, 1, ["mp_rank_00_000.pth", "mp_rank_00_001.pth"]),
        (1, 2, ["mp_rank_00_000.pth", "mp_rank_00_001.pth"]),
    ],
)
def test_file_per_model_parallel_rank(tmp_path, pipeline, experts, files):
    results = run_distributed(2, _dump, str(tmp_path / f"pp{pipeline}ep{experts}"), pipeline, experts)
    assert results == [files, files]
    saved = torch.load(tmp_path / f"pp{pipeline}ep{experts}" / "wgrads" / "iter_0000100" / files[-1], weights_only=True)
    assert type(saved) is dict and torch.equal(
        saved["model_chunk0"]["layer.weight"], torch.full((2, 2), 1.0 * (len(files) - 1))
    )


def test_needs_a_directory_and_an_iteration():
    with pytest.raises(ValueError, match=r"save_grads needs a save_dir and an iteration, got save_dir=None"):
        save_grads(None, {}, 1, "wgrads")
