"""pretrain_gpt.py with --optimizer dist_muon (Muon under the layer-wise distributed optimizer) on two data-parallel
ranks: the loss falls, the torch_dist checkpoint holds Muon's momentum beside Adam's moments, and resuming from
iteration 10 reproduces the uninterrupted run's iterations 11-20 exactly."""

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.functional_tests.configs import GOLDEN_FLAGS
from tests.functional_tests.harness import run_pretrain

MUON_FLAGS = ["--optimizer", "dist_muon", "--muon-nesterov", "--muon-fp32-matmul-prec", "high"]
CURVES = ("lm loss", "learning rate", "grad norm", "consumed samples")


@pytest.fixture(scope="module")
def dist_muon_run(tmp_path_factory, cpu_data_flags):
    save_dir = tmp_path_factory.mktemp("dist_muon_checkpoints")
    result = run_pretrain(GOLDEN_FLAGS + cpu_data_flags + MUON_FLAGS + ["--save", save_dir, "--save-interval", "10"], 2)
    return result, save_dir


def test_dist_muon_trains_and_checkpoints_muon_state(dist_muon_run):
    result, save_dir = dist_muon_run
    losses = result.curve()
    assert sorted(losses) == list(range(1, 21)), result.describe()
    assert losses[20] < losses[1] - 0.5, result.describe()
    keys = FileSystemReader(str(save_dir / "iter_0000010")).read_metadata().state_dict_metadata
    assert any(key.startswith("optimizer.state.momentum_buffer.") and "linear_qkv.weight" in key for key in keys)
    assert any(key.startswith("optimizer.state.exp_avg.") and "embedding" in key for key in keys)


def test_dist_muon_resume_reproduces_the_uninterrupted_run(dist_muon_run, cpu_data_flags):
    result, save_dir = dist_muon_run
    flags = GOLDEN_FLAGS + cpu_data_flags + MUON_FLAGS + ["--load", save_dir, "--ckpt-step", "10"]
    resumed = run_pretrain(flags, 2)
    assert min(resumed.curve()) == 11, resumed.describe()
    for key in CURVES:
        expected = {i: v for i, v in result.curve(key).items() if i > 10}
        assert resumed.curve(key) == expected, f"{key}\n{resumed.describe()}"
