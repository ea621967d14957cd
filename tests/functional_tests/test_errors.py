"""Bad command lines and missing or broken files end the job with a message that names the problem and the fix."""

import re

from tests.functional_tests.configs import GOLDEN_FLAGS, with_flag
from tests.functional_tests.harness import CPU_FLAGS, builtin_data_flags, run_pretrain


def _fails_with(flags, pattern: str) -> None:
    result = run_pretrain(flags, expect_success=False, timeout=120)
    assert result.returncode != 0, result.describe()
    assert re.search(pattern, result.output), f"expected /{pattern}/ in the output\n{result.describe()}"
    assert not result.records, "the job trained before failing"


def test_misspelled_flag_is_rejected_by_name(cpu_data_flags):
    _fails_with(
        GOLDEN_FLAGS + cpu_data_flags + ["--hiden-size", "64"],
        r"unknown flag --hiden-size; did you mean --hidden-size\?",
    )


def test_global_batch_not_divisible_by_micro_batch_times_data_parallel(cpu_data_flags):
    flags = with_flag(GOLDEN_FLAGS, "--global-batch-size", "10") + cpu_data_flags
    _fails_with(
        flags,
        re.escape("--global-batch-size (10) must be a multiple of --micro-batch-size (4) x data-parallel size (1)"),
    )


def test_missing_data_prefix_is_named(tmp_path):
    missing = tmp_path / "no_such_corpus_text_document"
    data_flags = with_flag(builtin_data_flags(), "--data-path", str(missing))
    _fails_with(
        GOLDEN_FLAGS + CPU_FLAGS + data_flags,
        rf"--data-path: no dataset at {re.escape(str(missing))} "
        r".*\.bin and .*\.idx must both exist.*preprocess_data\.py",
    )


def test_load_of_an_incomplete_checkpoint_names_the_missing_files(tmp_path, cpu_data_flags):
    """A save killed after its directory and metadata.json were written, before the tensors (and the common state
    they hold)."""
    checkpoint = tmp_path / "iter_0000010"
    checkpoint.mkdir()
    (checkpoint / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", '
        '"common_backend_version": 1}'
    )
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    _fails_with(
        GOLDEN_FLAGS + cpu_data_flags + ["--load", tmp_path],
        rf"checkpoint {re.escape(str(checkpoint))} .* is incomplete: \.metadata missing",
    )
