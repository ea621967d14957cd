"""The rerun state machine in its default (disabled) mode: each step runs once, bad results are rejected, the
checkpoint entry has Megatron's layout, and the re-running modes are refused."""

import logging

import pytest
import torch

from megatron.core import rerun_state_machine as rsm
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.rerun_state_machine import (
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)
from tests.unit_tests.test_utilities import run_distributed


@pytest.fixture(autouse=True)
def fresh_machine():
    destroy_rerun_state_machine()
    yield
    destroy_rerun_state_machine()


def test_each_step_runs_once_and_never_asks_to_checkpoint_or_exit():
    machine = get_rerun_state_machine()
    assert machine.get_mode() == RerunMode.DISABLED
    for step in range(3):
        runs = 0
        while machine.should_run_forward_backward(None):
            runs += 1
        assert runs == 1 and machine.current_iteration == step
        assert machine.should_checkpoint_and_exit() == (False, False, 0)


def test_the_process_has_one_machine():
    initialize_rerun_state_machine()
    with pytest.raises(RuntimeError, match="already initialized"):
        initialize_rerun_state_machine()
    assert get_rerun_state_machine() is get_rerun_state_machine()


@pytest.mark.parametrize("mode", [RerunMode.VALIDATE_RESULTS, RerunMode.REPORT_DETERMINISM_STATS])
def test_rerunning_modes_are_refused(mode):
    with pytest.raises(ValueError, match=f"not supported yet: re-running training steps \\(--rerun-mode={mode.value}"):
        RerunStateMachine(mode=mode)
    with pytest.raises(ValueError, match="not supported yet: .*error injection, error_injection_rate=10"):
        RerunErrorInjector(error_injection_rate=10)


def test_validate_result_rejects_bad_results(tmp_path, caplog):
    tracker = tmp_path / "rejected.txt"
    machine = RerunStateMachine(result_rejected_tracker_filename=str(tracker))
    machine.should_run_forward_backward(None)
    is_nan = lambda loss: bool(torch.isnan(loss))  # noqa: E731
    machine.validate_result(torch.tensor(1.0), is_nan, "NaN loss")  # accepted: nothing happens
    with pytest.raises(RuntimeError, match=r"Rank 0, iteration 0: NaN loss \(result: nan\)"):
        machine.validate_result(torch.tensor(float("nan")), is_nan, "NaN loss")
    with caplog.at_level(logging.WARNING, logger=rsm.__name__):
        machine.validate_result(torch.tensor(float("nan")), is_nan, "NaN loss", fatal=False)
    assert "NaN loss" in caplog.text
    assert tracker.read_text().count("status=rerun_disabled") == 2


def test_data_iterator_replays_what_a_rerunning_mode_recorded():
    iterator = RerunDataIterator(iter(range(10)))
    assert [next(iterator), next(iterator)] == [0, 1]  # disabled: nothing is kept
    assert iterator.saved_microbatches == []
    iterator.load_state_dict({"saved_microbatches": [4, 5], "replaying": False, "replay_pos": 0})
    iterator.rewind()
    assert [next(iterator), next(iterator)] == [4, 5]
    with pytest.raises(RuntimeError, match="more micro-batches than the step read"):
        next(iterator)
    iterator.advance()
    assert next(iterator) == 2
    assert iterator.state_dict()["saved_microbatches"] == [] and not iterator.state_dict()["replaying"]


def test_state_dict_layout_is_megatrons():
    machine = get_rerun_state_machine()
    machine.should_run_forward_backward(None)
    entry = machine.state_dict(None, "torch")
    assert entry["mode"] == RerunMode.DISABLED
    assert entry["sharded"] == {
        "state": RerunState.INITIAL_RUN,
        "current_iteration": 0,
        "rerun_requested": False,
        "checkpoint_requested": False,
        "restart_again_requested": False,
        "continue_requested": False,
        "error_injector_checkpoint": {
            "error_injection_rate": 0,
            "error_injection_type": RerunDiagnostic.TRANSIENT_ERROR,
            "injected_error_type": None,
        },
        "failed_validation_call": None,
        "initial_result": None,
        "suspicious_node": None,
        "suspicious_device": None,
        "data_iterator_checkpoints": None,
        "large_value_counts": {},
        "max_values": {},
    }
    # A checkpoint from a machine that was disabled, or loaded into a disabled one, leaves this one as it is.
    other = RerunStateMachine()
    other.load_state_dict(entry)
    assert other.current_iteration == -1


def _torch_dist_entry():
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    sharded = get_rerun_state_machine().state_dict(None, "torch_dist")["sharded"]
    destroy_rerun_state_machine()
    return (
        sharded.key,
        sharded.global_shape,
        sharded.global_offset,
        sharded.replica_id,
        isinstance(sharded, ShardedObject),
    )


def test_torch_dist_entry_is_one_object_per_pipeline_and_tensor_rank():
    # 4 ranks: TP2 x DP2; replicas over data-parallel ranks.
    assert run_distributed(4, _torch_dist_entry) == [
        ("rerun_state_machine_state", (1, 2), (0, 0), 0, True),
        ("rerun_state_machine_state", (1, 2), (0, 1), 0, True),
        ("rerun_state_machine_state", (1, 2), (0, 0), 1, True),
        ("rerun_state_machine_state", (1, 2), (0, 1), 1, True),
    ]
