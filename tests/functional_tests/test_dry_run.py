"""`--dry-run` prints the layout report (rank groups, stages, parameters, theoretical memory) and trains nothing."""

import re

from tests.functional_tests.configs import EQUIVALENCE_FLAGS, PARALLEL_LAYOUTS, with_flag
from tests.functional_tests.harness import run_pretrain


def test_dry_run_reports_the_layout_and_exits_without_training(tmp_path, cpu_data_flags, tp2_pp2_run):
    name, nproc, layout_flags = PARALLEL_LAYOUTS[0]
    assert name == "tp2_pp2_distopt"
    save_dir = tmp_path / "checkpoints"
    flags = (
        with_flag(EQUIVALENCE_FLAGS, "--train-iters", "10")
        + layout_flags
        + cpu_data_flags
        + [
            "--dry-run",
            "--save",
            save_dir,
            "--save-interval",
            "5",
        ]
    )
    result = run_pretrain(flags, nproc)
    report = result.output

    for expected in (
        "Parallel layout: 4 ranks = TP 2 x CP 1 x DP 1 x PP 2",
        "tensor-parallel             [0, 1] [2, 3]",
        "pipeline-parallel           [0, 2] [1, 3]",
        "data-parallel               [0] [1] [2] [3]",
        "stage 0 on ranks [0, 1]",
        "layers 0-1 + embedding",
        "stage 1 on ranks [2, 3]",
        "layers 2-3 + final norm + output layer",
        "Theoretical memory footprints:",
    ):
        assert expected in report, f"{expected!r} missing from the dry-run report\n{result.describe()}"
    assert report.count("Parallel layout:") == 1, "the report is printed by rank 0 only"

    # The report's per-rank parameter counts are those of the model the real run builds at this layout.
    predicted = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) per tensor-parallel rank", report)]
    built = [
        int(re.search(rf"model parallel rank \(0, {stage}\): (\d+)", tp2_pp2_run.result.output).group(1))
        for stage in range(2)
    ]
    assert predicted == built

    assert result.records == [] and "building train, validation, and test datasets" not in report
    assert not save_dir.exists() or not any(save_dir.iterdir())
