"""Mixture of experts through the real entry point: pretrain_gpt.py with Megatron-LM's MoE flags on CPU ranks.

A 2-layer GPT whose MLPs are 4 experts (top-2, all-to-all dispatcher, load-balancing loss and z-loss), fp32,
dropout 0 and layout-independent initialisation (experts keyed by their global index), on the built-in corpus:

- at EP=1 on one rank it reproduces its recorded curves (golden_values/gpt_moe_tiny_ep1.json: lm loss, both MoE
  losses as Megatron-LM logs them, learning rate, grad norm);
- at EP2 x PP2 with the distributed optimizer (4 ranks: DP 2, expert-DP 1) it trains like EP=1 for 5 iterations
  and saves;
- that checkpoint resumes at TP2 x EP2 with sequence parallelism (4 ranks: another pipeline and tensor layout, the
  experts resharded) and continues on the EP=1 curve through iteration 10.

Regenerate the record after an intended change of the numbers with

    MEGATRON_REGENERATE_GOLDEN_VALUES=1 python -m pytest tests/functional_tests/test_moe.py

Tolerances as in test_layout_equivalence / test_golden_values: layouts differ only in summation order (measured:
at most 2e-7 relative on the losses), one thread per rank makes the EP=1 run reproduce its record to the printed
digits; a broken reduction or dispatch moves the loss in its third digit.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.functional_tests.configs import EQUIVALENCE_FLAGS, with_flag
from tests.functional_tests.harness import assert_curves_close, run_pretrain

GOLDEN_FILE = Path(__file__).parent / "golden_values" / "gpt_moe_tiny_ep1.json"
REGENERATE_ENV = "MEGATRON_REGENERATE_GOLDEN_VALUES"
ITERATIONS, SAVED_AT = 10, 5
MOE_FLAGS = with_flag(with_flag(EQUIVALENCE_FLAGS, "--num-layers", "2"), "--train-iters", str(ITERATIONS)) + [
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
LOSS_REL_TOL = 1e-5
GRAD_NORM_ABS_TOL = 2e-3


@pytest.fixture(scope="module")
def moe_reference(cpu_data_flags):
    return run_pretrain(MOE_FLAGS + cpu_data_flags)


def _assert_like(result, reference, iterations, what):
    for key in LOSSES:
        expected = {i: v for i, v in reference.curve(key).items() if i in iterations}
        assert len(expected) == len(iterations), f"reference has no {key!r} for every iteration"
        assert_curves_close(result.curve(key), expected, LOSS_REL_TOL, f"{what}, {key}\n{result.describe()}")
    norms = result.curve("grad norm")
    for iteration, expected in reference.curve("grad norm").items():
        if iteration in iterations:
            assert abs(norms[iteration] - expected) <= GRAD_NORM_ABS_TOL, f"{what}: grad norm at {iteration}"
    assert {i: v for i, v in result.curve("learning rate").items() if i in iterations} == {
        i: v for i, v in reference.curve("learning rate").items() if i in iterations
    }


def test_ep1_moe_reproduces_its_golden_values(moe_reference):
    observed = {
        "description": "2-layer GPT, 4 experts top-2 (alltoall), aux loss 1e-2, z-loss 1e-3; 1 rank, fp32, "
        "OMP_NUM_THREADS=1; flags below plus the built-in data/tokenizer flags and the CPU switches",
        "regenerate": f"{REGENERATE_ENV}=1 python -m pytest tests/functional_tests/test_moe.py",
        "torch_version": torch.__version__,
        "flags": " ".join(MOE_FLAGS),
        **{
            key: {str(i): v for i, v in moe_reference.curve(key).items()}
            for key in LOSSES + ("learning rate", "grad norm")
        },
    }
    if os.environ.get(REGENERATE_ENV) == "1":
        GOLDEN_FILE.write_text(json.dumps(observed, indent=2) + "\n")
        pytest.skip(f"regenerated {GOLDEN_FILE}; review its diff and commit it")
    golden = json.loads(GOLDEN_FILE.read_text())
    assert golden["flags"] == observed["flags"], f"the MoE run's flags changed; regenerate: {golden['regenerate']}"
    for key in LOSSES + ("learning rate",):
        expected = {int(i): v for i, v in golden[key].items()}
        assert len(expected) == ITERATIONS, key
        actual = {int(i): v for i, v in observed[key].items()}
        assert_curves_close(actual, expected, 5e-6, f"EP=1 vs {GOLDEN_FILE.name}, {key}\n{moe_reference.describe()}")
    for iteration, expected in golden["grad norm"].items():
        assert abs(observed["grad norm"][iteration] - expected) <= GRAD_NORM_ABS_TOL, f"grad norm at {iteration}"


def test_ep2_pp2_then_resumed_at_tp2_ep2_sp_trains_like_ep1(moe_reference, cpu_data_flags, tmp_path):
    first = run_pretrain(
        MOE_FLAGS
        + cpu_data_flags
        + [
            "--pipeline-model-parallel-size",
            "2",
            "--expert-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
            "--dist-ckpt-optim-fully-reshardable",  # the default dp_reshardable layout keeps TP/PP fixed
            "--save",
            tmp_path,
            "--save-interval",
            str(SAVED_AT),
            "--exit-interval",
            str(SAVED_AT),
        ],
        nproc=4,
    )
    _assert_like(first, moe_reference, range(1, SAVED_AT + 1), "EP2 x PP2, distributed optimizer")
    resumed = run_pretrain(
        MOE_FLAGS
        + cpu_data_flags
        + [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--expert-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
            "--load",
            tmp_path,
        ],
        nproc=4,
    )
    assert f"loading checkpoint from {tmp_path} at iteration {SAVED_AT}" in resumed.output
    assert min(resumed.curve()) == SAVED_AT + 1
    _assert_like(resumed, moe_reference, range(SAVED_AT + 1, ITERATIONS + 1), "resumed at TP2 x EP2 x SP")
