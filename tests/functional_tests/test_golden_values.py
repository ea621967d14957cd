"""Golden values: a tiny GPT on the built-in corpus (TP1 PP1, fp32, one thread) reproduces its recorded curves.

The record (golden_values/gpt_tiny_tp1pp1.json) holds the lm loss, learning rate and grad norm of every one of the
20 iterations and the validation losses. Regenerate it after an intended change of the numbers with

    MEGATRON_REGENERATE_GOLDEN_VALUES=1 python -m pytest tests/functional_tests/test_golden_values.py

then review the diff of the JSON and commit it with the change that explains it.

Tolerances: one CPU thread per rank makes fp32 runs bit-reproducible on one machine, so the recorded curve is met
to the printed precision (7 significant digits). The loss and validation loss are allowed a relative 5e-6: running
with 2 threads per rank instead (a different summation order, as another CPU's kernels would use) moved them by at
most 1.2e-7, while a change to the model, data order, initialisation or schedule moves them by 1e-4 or more. The
learning rate comes from the schedule alone and must match to the printed digits; the grad norm is printed with 3
decimals and may differ by 2 in the last.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.functional_tests.configs import GOLDEN_FLAGS
from tests.functional_tests.harness import assert_curves_close, parse_validation_log

GOLDEN_FILE = Path(__file__).parent / "golden_values" / "gpt_tiny_tp1pp1.json"
REGENERATE_ENV = "MEGATRON_REGENERATE_GOLDEN_VALUES"
LOSS_REL_TOL = 5e-6
LR_REL_TOL = 1e-6
GRAD_NORM_ABS_TOL = 2e-3
CURVES = ("lm loss", "learning rate", "grad norm")


def _observed(result) -> dict:
    validation = parse_validation_log(result.output)
    return {
        "description": "2-layer GPT (hidden 64, 4 heads, seq 64) on the built-in Shakespeare corpus; 1 rank, fp32, "
        "OMP_NUM_THREADS=1; flags below plus the built-in data/tokenizer flags and the CPU switches",
        "regenerate": f"{REGENERATE_ENV}=1 python -m pytest tests/functional_tests/test_golden_values.py",
        "torch_version": torch.__version__,
        "flags": " ".join(GOLDEN_FLAGS),
        **{key: {str(i): v for i, v in result.curve(key).items()} for key in CURVES},
        "validation lm loss": {where: fields["lm loss value"] for where, fields in validation.items()},
    }


def _as_curve(values: dict) -> dict:
    return {int(i): v for i, v in values.items()}


def test_tiny_gpt_reproduces_its_golden_values(golden_run):
    observed = _observed(golden_run.result)
    if os.environ.get(REGENERATE_ENV) == "1":
        GOLDEN_FILE.parent.mkdir(exist_ok=True)
        GOLDEN_FILE.write_text(json.dumps(observed, indent=2) + "\n")
        pytest.skip(f"regenerated {GOLDEN_FILE}; review its diff and commit it")
    golden = json.loads(GOLDEN_FILE.read_text())
    assert golden["flags"] == " ".join(GOLDEN_FLAGS), (
        f"the golden run's flags changed since {GOLDEN_FILE.name} was recorded; if intended, regenerate with "
        f"{golden['regenerate']}"
    )
    assert len(golden["lm loss"]) == 20
    what = f"golden run vs {GOLDEN_FILE.name}\n{golden_run.result.describe()}"
    assert_curves_close(_as_curve(observed["lm loss"]), _as_curve(golden["lm loss"]), LOSS_REL_TOL, what)
    assert_curves_close(_as_curve(observed["learning rate"]), _as_curve(golden["learning rate"]), LR_REL_TOL, what)
    for iteration, expected in _as_curve(golden["grad norm"]).items():
        actual = _as_curve(observed["grad norm"])[iteration]
        assert abs(actual - expected) <= GRAD_NORM_ABS_TOL, f"grad norm, iteration {iteration}: {actual} vs {expected}"
    assert set(observed["validation lm loss"]) == set(golden["validation lm loss"])
    for where, expected in golden["validation lm loss"].items():
        assert observed["validation lm loss"][where] == pytest.approx(expected, rel=LOSS_REL_TOL), where
