"""Constant, ramp-up and step global batch sizes, the module-level getters, and bad settings."""

import inspect

import pytest

from megatron.core import num_microbatches_calculator as mb


@pytest.fixture(autouse=True)
def fresh_calculator():
    mb.unset_num_microbatches_calculator()
    yield
    mb.unset_num_microbatches_calculator()


def test_constant_global_batch_size():
    mb.init_num_microbatches_calculator(0, None, global_batch_size=32, micro_batch_size=2, data_parallel_size=4)
    assert mb.get_num_microbatches() == 4
    assert mb.get_current_global_batch_size() == mb.get_current_running_global_batch_size() == 32
    assert mb.get_micro_batch_size() == 2
    mb.update_num_microbatches(10_000)
    assert mb.get_num_microbatches() == 4
    with pytest.raises(RuntimeError, match="already initialized; use reconfigure_num_microbatches_calculator"):
        mb.init_num_microbatches_calculator(0, None, 32, 2, 4)
    mb.reconfigure_num_microbatches_calculator(0, None, 16, 1, 4)
    assert mb.get_num_microbatches() == 4 and mb.get_micro_batch_size() == 1


def test_constant_batch_size_rounds_down_only_when_asked():
    with pytest.raises(
        ValueError,
        match=r"global batch size \(30\) is not divisible by micro batch size \(2\) "
        r"times data parallel size \(4\)",
    ):
        mb.init_num_microbatches_calculator(0, None, 30, 2, 4)
    mb.init_num_microbatches_calculator(0, None, 30, 2, 4, decrease_batch_size_if_needed=True)
    assert mb.get_current_global_batch_size() == 30
    assert mb.get_current_running_global_batch_size() == 24 and mb.get_num_microbatches() == 3
    with pytest.raises(
        ValueError,
        match=r"global batch size \(6\) is smaller than micro batch size \(2\) times data "
        r"parallel size \(4\): no micro-batch fits",
    ):
        mb.reconfigure_num_microbatches_calculator(0, None, 6, 2, 4, decrease_batch_size_if_needed=True)


def test_rampup_grows_evenly_over_the_rampup_samples():
    # 8 -> 32 in steps of 8 over 300 samples: 3 increments, one every 100 samples.
    mb.init_num_microbatches_calculator(0, [8, 8, 300], global_batch_size=32, micro_batch_size=2, data_parallel_size=2)
    seen = {}
    for consumed in (0, 99, 100, 199, 200, 299, 300, 301, 10_000):
        mb.update_num_microbatches(consumed, consistency_check=True)
        seen[consumed] = (mb.get_current_global_batch_size(), mb.get_num_microbatches())
    assert seen == {
        0: (8, 2),
        99: (8, 2),
        100: (16, 4),
        199: (16, 4),
        200: (24, 6),
        299: (24, 6),
        300: (32, 8),
        301: (32, 8),
        10_000: (32, 8),
    }


def test_rampup_consistency_check_and_rounding():
    # 6 is not a multiple of micro 2 x dp 2 = 4.
    mb.init_num_microbatches_calculator(0, [4, 2, 100], global_batch_size=8, micro_batch_size=2, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"global batch size \(6\) is not divisible"):
        mb.update_num_microbatches(50, consistency_check=True)
    mb.update_num_microbatches(50, consistency_check=False)
    assert mb.get_current_global_batch_size() == 6
    mb.reconfigure_num_microbatches_calculator(0, [4, 2, 100], 8, 2, 2, decrease_batch_size_if_needed=True)
    mb.update_num_microbatches(50)
    assert (mb.get_current_global_batch_size(), mb.get_current_running_global_batch_size()) == (6, 4)
    assert mb.get_num_microbatches() == 1


def test_rampup_with_nothing_to_ramp_is_constant():
    mb.init_num_microbatches_calculator(0, [16, 8, 100], 16, 2, 2)
    mb.update_num_microbatches(50)
    assert mb.get_current_global_batch_size() == 16 and mb.get_num_microbatches() == 4


@pytest.mark.parametrize(
    "args, message",
    [
        ((None, 32, 0, 4), "micro_batch_size must be a positive integer, got 0"),
        ((None, 2, 2, 4), r"global batch size \(2\) is not divisible"),
        (([8, 8], 32, 2, 2), r"rampup_batch_size must be \[start batch size, batch size increment, ramp-up samples\]"),
        (([0, 8, 100], 32, 2, 2), "start_global_batch_size must be a positive integer, got 0"),
        (([8, 0, 100], 32, 2, 2), "batch_size_increment must be a positive integer, got 0"),
        (([8, 8, -1], 32, 2, 2), "ramp-up samples must be >= 0, got -1"),
        (([64, 8, 100], 32, 2, 2), r"global batch size \(32\) to be greater than or equal to the start batch size"),
        (([8, 5, 100], 32, 2, 2), r"interval \(24\) to be divisible by the batch size increment \(5\)"),
    ],
)
def test_bad_settings_are_rejected(args, message):
    rampup, global_batch_size, micro_batch_size, data_parallel_size = args
    with pytest.raises(ValueError, match=message):
        mb.init_num_microbatches_calculator(0, rampup, global_batch_size, micro_batch_size, data_parallel_size)


def test_getters_need_a_calculator():
    with pytest.raises(RuntimeError, match="not initialized; call init_num_microbatches_calculator"):
        mb.get_num_microbatches()


def test_init_takes_megatrons_keyword_defaults():
    # Megatron's order: rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, ...
    mb.init_num_microbatches_calculator(0, None, 32, 8, 2, False)
    assert mb.get_num_microbatches() == 2
    with pytest.raises(ValueError, match="global_batch_size is None"):
        mb.reconfigure_num_microbatches_calculator(0, micro_batch_size=2, data_parallel_size=2)


def test_step_schedule_in_samples_follows_every_threshold():
    mb.init_num_microbatches_calculator(
        0, micro_batch_size=2, data_parallel_size=2, step_batch_size_schedule="0:4 100:8 1K:16"
    )
    seen = {}
    for consumed in (0, 99, 100, 999, 1000, 10**6):
        mb.update_num_microbatches(consumed, consistency_check=True)
        seen[consumed] = (mb.get_current_global_batch_size(), mb.get_num_microbatches())
    assert seen == {0: (4, 1), 99: (4, 1), 100: (8, 2), 999: (8, 2), 1000: (16, 4), 10**6: (16, 4)}


def test_step_schedule_counts_tokens_with_seq_length():
    # 1.5K tokens at seq_length 10 is 150 samples; 2B tokens is 200M samples.
    mb.init_num_microbatches_calculator(
        0, micro_batch_size=1, data_parallel_size=2, step_batch_size_schedule="0:2 1.5K:6 2B:10", seq_length=10
    )
    for consumed, expected in ((149, 2), (150, 6), (199_999_999, 6), (200_000_000, 10)):
        mb.update_num_microbatches(consumed)
        assert mb.get_current_global_batch_size() == expected, consumed


def test_step_schedule_checks_divisibility_when_an_entry_is_reached():
    # 6 does not split into micro 2 x dp 2 slices; it is only refused once training reaches it.
    mb.init_num_microbatches_calculator(
        0, micro_batch_size=2, data_parallel_size=2, step_batch_size_schedule="0:4 100:6"
    )
    mb.update_num_microbatches(50)
    with pytest.raises(ValueError, match=r"global batch size \(6\) is not divisible"):
        mb.update_num_microbatches(100, consistency_check=True)


@pytest.mark.parametrize(
    "schedule, message",
    [
        ("10:4 100:8", "must start at threshold 0"),
        ("0:4 100:8 50:16", "thresholds must be strictly increasing"),
        ("0:4 100", r"'100' is not THRESHOLD:BATCH_SIZE"),
        ("0:4 1X:8", r"threshold '1X' is not a whole non-negative number"),
        ("0:0", "with a positive batch size"),
        ("", "must start at threshold 0"),
    ],
)
def test_bad_step_schedules_are_rejected(schedule, message):
    with pytest.raises(ValueError, match=message):
        mb.init_num_microbatches_calculator(
            0, micro_batch_size=1, data_parallel_size=1, step_batch_size_schedule=schedule
        )


def test_step_schedule_and_rampup_are_exclusive():
    with pytest.raises(ValueError, match="are both set; give one batch-size schedule"):
        mb.init_num_microbatches_calculator(0, [4, 4, 100], 8, 1, 1, step_batch_size_schedule="0:4")


def test_step_calculator_class_directly():
    calculator = mb.StepBatchsizeNumMicroBatchesCalculator(2, 1, False, 0, "0:2 10:4")
    calculator.update(10, consistency_check=True, verbose=True)
    assert (calculator.get(), calculator.get_current_global_batch_size(), calculator.get_micro_batch_size()) == (
        2,
        4,
        2,
    )


def test_build_helper_has_megatrons_signature():
    # Megatron 0.19: (rank, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed,
    # step_batch_size_schedule=None, seq_length=None); ramp-up is set up by init/reconfigure only.
    params = list(inspect.signature(mb._build_num_microbatches_calculator).parameters)
    assert params == [
        "rank",
        "global_batch_size",
        "micro_batch_size",
        "data_parallel_size",
        "decrease_batch_size_if_needed",
        "step_batch_size_schedule",
        "seq_length",
    ]
    calculator = mb._build_num_microbatches_calculator(0, 32, 8, 2, False)
    assert type(calculator) is mb.ConstantNumMicroBatchesCalculator
    assert (calculator.get(), calculator.get_current_global_batch_size()) == (2, 32)
    step = mb._build_num_microbatches_calculator(
        0, None, 2, 1, False, step_batch_size_schedule="0:2 10:4", seq_length=1
    )
    assert type(step) is mb.StepBatchsizeNumMicroBatchesCalculator


def test_step_schedule_refuses_decrease_batch_size_if_needed():
    # As Megatron's calculator does, whether built directly or through init.
    message = r"step_batch_size_schedule='0:16 100:32' cannot be combined with decrease_batch_size_if_needed=True"
    with pytest.raises(ValueError, match=message):
        mb._build_num_microbatches_calculator(0, None, 8, 2, True, step_batch_size_schedule="0:16 100:32")
    with pytest.raises(ValueError, match=message):
        mb.StepBatchsizeNumMicroBatchesCalculator(1, 2, True, 0, "0:16 100:32")


def test_rampup_needs_a_global_batch_size():
    with pytest.raises(ValueError, match="rampup_batch_size ramps up to it, so set it"):
        mb.init_num_microbatches_calculator(0, [4, 4, 100], None, 1, 1)
