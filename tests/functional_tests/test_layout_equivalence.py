"""Layout equivalence through the real entry point: every parallel layout trains like the single process.

Each layout runs the same 4-layer GPT (fp32, dropout 0, `--use-cpu-initialization` so the full weights do not depend
on the layout) on the same global batches for 10 iterations; its loss curve must match TP1 PP1 DP1's.

Tolerance: a relative 1e-5 on the loss (DESIGN.md's fp32 equivalence bound). The layouts differ only in summation
order (split matmuls, all-reduces, sharded optimizer steps); over 10 steps that moved the printed loss by at most
2.4e-7 relative (measured for all four layouts), while a real bug (a missing all-reduce, a wrong shard, a skipped
micro-batch) changes the loss in its third digit or earlier. The grad norm, printed with 3 decimals, may differ by 2 in
the last; learning rate and consumed samples
must be identical.
"""

import pytest

from tests.functional_tests.configs import EQUIVALENCE_FLAGS, EQUIVALENCE_ITERS, PARALLEL_LAYOUTS, with_flag
from tests.functional_tests.harness import assert_curves_close, run_pretrain

LOSS_REL_TOL = 1e-5
GRAD_NORM_ABS_TOL = 2e-3


def _first_iterations(curve: dict, count: int = EQUIVALENCE_ITERS) -> dict:
    return {i: v for i, v in curve.items() if i <= count}


def assert_trains_like_reference(result, reference, what: str) -> None:
    expected = _first_iterations(reference.curve())
    assert len(expected) == EQUIVALENCE_ITERS
    assert_curves_close(_first_iterations(result.curve()), expected, LOSS_REL_TOL, f"{what}\n{result.describe()}")
    for key in ("learning rate", "consumed samples"):
        assert _first_iterations(result.curve(key)) == _first_iterations(reference.curve(key)), key
    grad_norms = _first_iterations(result.curve("grad norm"))
    for iteration, expected_norm in _first_iterations(reference.curve("grad norm")).items():
        assert abs(grad_norms[iteration] - expected_norm) <= GRAD_NORM_ABS_TOL, (
            f"{what}: grad norm at iteration {iteration}: {grad_norms[iteration]} vs {expected_norm}"
        )


def test_tp2_pp2_with_distributed_optimizer_trains_like_one_process(tp2_pp2_run, equivalence_reference):
    assert f"exiting program at iteration {EQUIVALENCE_ITERS}" in tp2_pp2_run.result.output
    assert_trains_like_reference(tp2_pp2_run.result, equivalence_reference, "TP2 x PP2, distributed optimizer")


@pytest.mark.parametrize(
    "nproc, layout_flags",
    [pytest.param(nproc, flags, id=name) for name, nproc, flags in PARALLEL_LAYOUTS[1:]],
)
def test_layout_trains_like_one_process(nproc, layout_flags, equivalence_reference, cpu_data_flags):
    flags = with_flag(EQUIVALENCE_FLAGS, "--train-iters", str(EQUIVALENCE_ITERS)) + layout_flags + cpu_data_flags
    result = run_pretrain(flags, nproc)
    assert_trains_like_reference(result, equivalence_reference, " ".join(layout_flags))
