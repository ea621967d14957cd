"""pretrain_hybrid.py with MoE layers: a tiny "M*E-" hybrid (4 experts, top-2, alltoall, aux loss and z-loss) at
EP=2 on 2 CPU ranks (DP 2, expert-DP 1) trains, logs the MoE losses averaged over its one 'E' layer, and agrees
with the same model on one rank at EP=1 (no dropout, layout-independent initialisation: the layouts differ only in
summation order)."""

import pytest

from tests.functional_tests.harness import REPO_ROOT, assert_curves_close, run_pretrain
from tests.functional_tests.test_hybrid import HYBRID_FLAGS
from tests.functional_tests.configs import with_flag

ENTRY_POINT = REPO_ROOT / "pretrain_hybrid.py"
ITERATIONS = 6
_SINGLE_RANK = [flag for flag in HYBRID_FLAGS if flag not in ("--sequence-parallel", "--use-distributed-optimizer")]
FLAGS = with_flag(
    with_flag(
        with_flag(with_flag(_SINGLE_RANK, "--tensor-model-parallel-size", "1"), "--hybrid-layer-pattern", "M*E-"),
        "--train-iters",
        str(ITERATIONS),
    ),
    "--lr-decay-iters",
    str(ITERATIONS),
) + [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "64",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
]
LOSSES = ("lm loss", "load_balancing_loss", "z_loss")


@pytest.fixture(scope="module")
def ep1_run(cpu_data_flags):
    return run_pretrain(FLAGS + cpu_data_flags, nproc=1, entry_point=ENTRY_POINT)


def test_hybrid_moe_trains_at_ep2_like_ep1(ep1_run, cpu_data_flags):
    losses = ep1_run.curve("lm loss")
    assert len(losses) == ITERATIONS and losses[ITERATIONS] < losses[1] - 0.1  # it learns (9.04 -> 8.84 measured)
    # The logged balancing loss (coefficient not applied) is about 1 for balanced routing: averaged over the one 'E'
    # layer, not over all 4 layers of the pattern (that would log about 0.25). Measured 1.001-1.011.
    assert all(0.95 < value < 1.5 for value in ep1_run.curve("load_balancing_loss").values())
    ep2 = run_pretrain(
        FLAGS + cpu_data_flags + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
        nproc=2,
        entry_point=ENTRY_POINT,
    )
    for key in LOSSES:
        assert_curves_close(ep2.curve(key), ep1_run.curve(key), 1e-5, f"EP2 vs EP1, {key}\n{ep2.describe()}")
