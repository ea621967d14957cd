"""``pretrain_gpt.py --use-torch-fsdp2`` end to end: the loss and grad-norm curves of plain DDP at DP2 (also at
TP2 x DP2 with SP, CP2 x DP2, under no_sync with full recompute, and with per-token loss), and a checkpoint saved
under FSDP2 that resumes under plain DDP at another data-parallel size with the same losses."""

import pytest

from tests.functional_tests.configs import EQUIVALENCE_FLAGS, with_flag
from tests.functional_tests.harness import assert_curves_close, run_pretrain
from tests.functional_tests.test_layout_equivalence import LOSS_REL_TOL

ITERS = 4
FLAGS = with_flag(EQUIVALENCE_FLAGS, "--train-iters", str(ITERS)) + ["--untie-embeddings-and-output-weights"]


@pytest.fixture(scope="module")
def ddp_dp2_run(cpu_data_flags):
    return run_pretrain(FLAGS + cpu_data_flags, nproc=2)


def test_fsdp2_trains_like_ddp_and_its_checkpoint_resumes_under_ddp(ddp_dp2_run, cpu_data_flags, tmp_path):
    ddp_dp2_curve = ddp_dp2_run.curve()
    fsdp2 = run_pretrain(
        FLAGS + cpu_data_flags + ["--use-torch-fsdp2", "--save", tmp_path, "--save-interval", "2"], nproc=2
    )
    for key in ("lm loss", "grad norm"):
        assert_curves_close(fsdp2.curve(key), ddp_dp2_run.curve(key), LOSS_REL_TOL, f"FSDP2 DP2 {key} vs DDP DP2")
    resumed = run_pretrain(FLAGS + cpu_data_flags + ["--load", tmp_path, "--ckpt-step", "2"], nproc=1)
    assert "successfully loaded checkpoint" in resumed.output
    expected = {i: loss for i, loss in ddp_dp2_curve.items() if i > 2}
    assert_curves_close(resumed.curve(), expected, LOSS_REL_TOL, "DDP DP1 resumed from the FSDP2 DP2 checkpoint")


@pytest.mark.parametrize(
    "name, nproc, layout",
    [
        ("TP2 x DP2", 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("CP2 x DP2", 4, ["--context-parallel-size", "2"]),  # FSDP2 shards over the DP x CP group
        # The schedule runs micro-batch 1 of 2 under no_sync(); under full recompute FSDP2 prefetches the previous
        # layer during each layer's backward. One run checks both.
        (
            "DP2 with no_sync and full recompute",
            2,
            ["--overlap-grad-reduce", "--recompute-granularity", "full", "--recompute-method", "uniform"]
            + ["--recompute-num-layers", "1"],
        ),
    ],
)
def test_fsdp2_in_other_layouts_trains_like_ddp(ddp_dp2_run, cpu_data_flags, name, nproc, layout):
    result = run_pretrain(FLAGS + cpu_data_flags + ["--use-torch-fsdp2"] + layout, nproc=nproc)
    for key in ("lm loss", "grad norm"):
        assert_curves_close(result.curve(key), ddp_dp2_run.curve(key), LOSS_REL_TOL, f"FSDP2 {name} {key} vs DDP DP2")


def test_fsdp2_with_per_token_loss_sums_gradients_like_ddp(ddp_dp2_run, cpu_data_flags):
    # Every token counts here (no loss mask), so per-token normalisation gives DDP's mean-loss curves exactly; a
    # gradient off by a constant factor shows in the grad norm (Adam would hide it in the loss).
    fsdp2 = run_pretrain(FLAGS + cpu_data_flags + ["--calculate-per-token-loss", "--use-torch-fsdp2"], nproc=2)
    for key in ("lm loss", "grad norm"):
        assert_curves_close(fsdp2.curve(key), ddp_dp2_run.curve(key), LOSS_REL_TOL, f"per-token {key}: FSDP2 vs DDP")
