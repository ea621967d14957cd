"""Checkpoint and resume through the real entry point.

* Same layout: resuming the golden run from its iteration-10 checkpoint reproduces iterations 11-20 exactly,
  dropout included (model, optimizer, LR scheduler, RNG state and the data position are all restored).
* Another layout: a TP2 x PP2 checkpoint (distributed optimizer) loaded at TP1 x DP2 holds exactly the same weights
  and optimizer state (checked by re-saving it there and comparing every tensor), and training continues on the
  single-process curve within the layout-equivalence tolerance. The RNG state is per (pipeline, tensor) rank, so it
  is not restored across layouts (the run says so); with dropout 0 that does not change the numbers.
* SIGTERM: a job started with --exit-signal-handler and signalled mid-run saves at the next iteration boundary and
  exits; resuming continues the curve.
"""

import re
import signal

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.functional_tests.configs import (
    EQUIVALENCE_FLAGS,
    EQUIVALENCE_ITERS,
    EQUIVALENCE_REFERENCE_ITERS,
    GOLDEN_FLAGS,
    with_flag,
)
from tests.functional_tests.harness import PretrainProcess, assert_curves_close, parse_validation_log, run_pretrain
from tests.functional_tests.test_layout_equivalence import LOSS_REL_TOL

CURVES = ("lm loss", "learning rate", "grad norm", "consumed samples")


def _after(curve: dict, iteration: int) -> dict:
    return {i: v for i, v in curve.items() if i > iteration}


def _tracker_iteration(save_dir) -> int:
    return int((save_dir / "latest_checkpointed_iteration.txt").read_text())


def test_resume_at_the_same_layout_reproduces_the_uninterrupted_run(golden_run, cpu_data_flags):
    assert _tracker_iteration(golden_run.checkpoint_dir) == 20
    resumed = run_pretrain(GOLDEN_FLAGS + cpu_data_flags + ["--load", golden_run.checkpoint_dir, "--ckpt-step", "10"])
    assert "successfully loaded checkpoint" in resumed.output
    assert min(resumed.curve()) == 11
    for key in CURVES:
        assert resumed.curve(key) == _after(golden_run.result.curve(key), 10), f"{key}\n{resumed.describe()}"
    # The validation iterator resumes where it was: iteration 20's validation batches are the uninterrupted run's.
    assert parse_validation_log(resumed.output) == {
        where: fields for where, fields in parse_validation_log(golden_run.result.output).items() if "20" in where
    }


def _checkpoint_tensors(checkpoint_dir, tmp_path) -> dict:
    """Every tensor of a distributed checkpoint, assembled to its global shape (keys do not depend on the layout)."""
    converted = tmp_path / f"{checkpoint_dir.parent.name}_{checkpoint_dir.name}.pt"
    dcp_to_torch_save(checkpoint_dir, converted)
    return {k: v for k, v in torch.load(converted, weights_only=False).items() if isinstance(v, torch.Tensor)}


def test_resharded_resume_restores_weights_and_optimizer_state_exactly(tp2_pp2_run, cpu_data_flags, tmp_path):
    assert _tracker_iteration(tp2_pp2_run.checkpoint_dir) == EQUIVALENCE_ITERS
    resave_dir = tmp_path / "tp1_dp2"
    # Loading at iteration 10 with --train-iters 10 trains nothing and saves at the end: the loaded state, re-saved.
    flags = (
        with_flag(EQUIVALENCE_FLAGS, "--train-iters", str(EQUIVALENCE_ITERS))
        + cpu_data_flags
        + [
            "--use-distributed-optimizer",
            "--load",
            tp2_pp2_run.checkpoint_dir,
            "--use-checkpoint-opt-param-scheduler",
            "--save",
            resave_dir,
            "--save-interval",
            "1000",
            "--dist-ckpt-optim-fully-reshardable",
        ]
    )
    result = run_pretrain(flags, nproc=2)
    assert result.records == [] and _tracker_iteration(resave_dir) == EQUIVALENCE_ITERS, result.describe()

    saved = _checkpoint_tensors(tp2_pp2_run.checkpoint_dir / "iter_0000010", tmp_path)
    resaved = _checkpoint_tensors(resave_dir / "iter_0000010", tmp_path)
    assert sorted(saved) == sorted(resaved)
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in saved)
    differing = [key for key in saved if not torch.equal(saved[key], resaved[key])]
    assert differing == [], f"tensors changed by loading at TP1 x DP2 and saving again: {differing}"


def test_resharded_resume_continues_the_single_process_curve(tp2_pp2_run, equivalence_reference, cpu_data_flags):
    flags = (
        with_flag(EQUIVALENCE_FLAGS, "--train-iters", str(EQUIVALENCE_REFERENCE_ITERS))
        + cpu_data_flags
        + [
            "--use-distributed-optimizer",
            "--load",
            tp2_pp2_run.checkpoint_dir,
        ]
    )
    resumed = run_pretrain(flags, nproc=2)
    assert "RNG state not restored" in resumed.output
    assert_curves_close(
        resumed.curve(),
        _after(equivalence_reference.curve(), EQUIVALENCE_ITERS),
        LOSS_REL_TOL,
        f"TP2 x PP2 checkpoint resumed at TP1 x DP2\n{resumed.describe()}",
    )
    assert resumed.curve("learning rate") == _after(equivalence_reference.curve("learning rate"), EQUIVALENCE_ITERS)


def test_sigterm_saves_a_checkpoint_and_a_resume_continues(equivalence_reference, cpu_data_flags, tmp_path):
    """PP2: the two ranks hold different halves of the model and must agree to stop at the same iteration.

    The signal goes to the whole process group (torchrun and both ranks), as a scheduler sends it. The job reads
    its data in the main process (--num-workers 0): DataLoader worker processes die on SIGTERM (PyTorch installs
    its own handler in them), which would break the rank's next batch before it can save.
    """
    save_dir = tmp_path / "checkpoints"
    planned_iters = 100  # far more than it will run: the signal, not the end of training, must stop it
    common = EQUIVALENCE_FLAGS + cpu_data_flags + ["--pipeline-model-parallel-size", "2", "--num-workers", "0"]
    job = PretrainProcess(
        with_flag(common, "--train-iters", str(planned_iters))
        + ["--exit-signal-handler", "--save", save_dir, "--save-interval", "1000"],
        nproc=2,
    )
    job.wait_for_line(lambda line: re.search(r"iteration\s+3/", line) is not None)
    job.send_signal_to_group(signal.SIGTERM)
    interrupted = job.wait(timeout=120)

    match = re.search(r"exiting program after receiving a termination signal at iteration (\d+)", interrupted.output)
    assert match, interrupted.describe()
    stopped_at = int(match.group(1))
    assert 3 <= stopped_at < planned_iters
    assert max(interrupted.curve()) == stopped_at
    assert _tracker_iteration(save_dir) == stopped_at
    assert interrupted.output.count("successfully saved checkpoint") == 1, interrupted.describe()

    # Resume with the reference's length; the schedule's planned length comes from the checkpoint.
    resumed = run_pretrain(
        with_flag(common, "--train-iters", str(EQUIVALENCE_REFERENCE_ITERS))
        + ["--load", save_dir, "--use-checkpoint-opt-param-scheduler"],
        nproc=2,
    )
    assert min(resumed.curve()) == stopped_at + 1
    assert_curves_close(
        resumed.curve(),
        _after(equivalence_reference.curve(), stopped_at),
        LOSS_REL_TOL,
        f"resumed after SIGTERM at iteration {stopped_at}\n{resumed.describe()}",
    )


def test_use_checkpoint_args_takes_the_model_shape_from_the_checkpoint(golden_run, cpu_data_flags):
    """--use-checkpoint-args: a resume with other shape flags on its command line still builds the saved model."""
    flags = with_flag(with_flag(GOLDEN_FLAGS, "--hidden-size", "128"), "--num-layers", "4")
    resumed = run_pretrain(
        flags + cpu_data_flags + ["--load", golden_run.checkpoint_dir, "--ckpt-step", "10", "--use-checkpoint-args"]
    )
    assert "successfully loaded checkpoint" in resumed.output
    assert resumed.curve() == _after(golden_run.result.curve(), 10), resumed.describe()


def test_use_checkpoint_args_without_a_checkpoint_names_the_directory(cpu_data_flags, tmp_path):
    result = run_pretrain(
        GOLDEN_FLAGS + cpu_data_flags + ["--load", str(tmp_path / "none"), "--use-checkpoint-args"],
        expect_success=False,
    )
    assert result.returncode != 0
    assert f"--use-checkpoint-args: no checkpoint to take the arguments from in {tmp_path / 'none'}" in result.output
