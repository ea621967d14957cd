"""OptimizerParamScheduler against the closed forms of every schedule, its state dict, and its bad settings."""

import math

import pytest

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class FakeOptimizer:
    def __init__(self):
        self.param_groups = [
            {"lr_mult": 1.0, "wd_mult": 1.0},
            {"lr_mult": 2.0, "wd_mult": 0.0},
            {"lr_mult": 1.0, "wd_mult": 1.0, "max_lr": 0.5, "min_lr": 0.05},  # e.g. decoupled_lr
        ]


MAX_LR, MIN_LR, INIT_LR, WARMUP, DECAY, WSD_WINDOW = 1.0, 0.1, 0.01, 100, 1000, 400


def make(style="linear", wsd=None, warmup=WARMUP, wd_style="linear", **overrides):
    settings = dict(
        init_lr=INIT_LR,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        lr_warmup_steps=warmup,
        lr_decay_steps=DECAY,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=DECAY,
        wd_incr_style=wd_style,
        wsd_decay_steps=WSD_WINDOW if style == "WSD" else None,
        lr_wsd_decay_style=wsd,
    )
    settings.update(overrides)
    return OptimizerParamScheduler(FakeOptimizer(), **settings)


def closed_form_lr(n, style, wsd=None, max_lr=MAX_LR, min_lr=MIN_LR, warmup=WARMUP):
    """megatron-compat.md e3, written out independently of the implementation."""
    if warmup > 0 and n <= warmup:
        return INIT_LR + (max_lr - INIT_LR) * n / warmup
    if style == "constant":
        return max_lr
    if n > DECAY:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    r = (n - warmup) / (DECAY - warmup)
    if style == "linear":
        coeff = 1 - r
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * r) + 1)
    else:
        start = DECAY - WSD_WINDOW
        rho = max(0.0, (n - start) / WSD_WINDOW)
        coeff = (
            {
                "linear": 1 - rho,
                "cosine": 0.5 * (math.cos(math.pi * rho) + 1),
                "exponential": 2 * 0.5**rho - 1,
                "minus_sqrt": 1 - math.sqrt(rho),
            }[wsd]
            if n > start
            else 1.0
        )
    return min_lr + coeff * (max_lr - min_lr)


SAMPLED_STEPS = [0, 1, 50, 100, 101, 250, 550, 600, 601, 777, 999, 1000, 1001, 5000]
SCHEDULES = [("constant", None), ("linear", None), ("cosine", None), ("inverse-square-root", None)] + [
    ("WSD", sub) for sub in ("linear", "cosine", "exponential", "minus_sqrt")
]


@pytest.mark.parametrize("style, wsd", SCHEDULES)
def test_learning_rate_matches_closed_form_at_sampled_steps(style, wsd):
    scheduler = make(style, wsd)
    groups = scheduler.optimizer.param_groups
    previous = 0
    for n in SAMPLED_STEPS:
        scheduler.step(n - previous)
        previous = n
        assert groups[0]["lr"] == pytest.approx(closed_form_lr(n, style, wsd), rel=1e-12, abs=1e-15)
        assert groups[1]["lr"] == pytest.approx(2.0 * closed_form_lr(n, style, wsd), rel=1e-12, abs=1e-15)
        per_group = closed_form_lr(n, style, wsd, max_lr=0.5, min_lr=0.05)
        assert groups[2]["lr"] == pytest.approx(per_group, rel=1e-12, abs=1e-15)


def test_first_update_uses_init_lr_and_no_warmup_starts_at_max():
    assert make().optimizer.param_groups[0]["lr"] == INIT_LR
    assert make(warmup=0).optimizer.param_groups[0]["lr"] == MAX_LR
    assert make("inverse-square-root", warmup=0).get_lr({}) == MAX_LR


@pytest.mark.parametrize("wd_style", ["linear", "cosine"])
def test_weight_decay_increment_matches_closed_form(wd_style):
    scheduler = make(wd_style=wd_style)
    previous = 0
    for n in SAMPLED_STEPS:
        scheduler.step(n - previous)
        previous = n
        r = n / DECAY
        coeff = r if wd_style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
        expected = 0.1 if n > DECAY else 0.1 * coeff
        assert scheduler.optimizer.param_groups[0]["weight_decay"] == pytest.approx(expected, abs=1e-15)
        assert scheduler.optimizer.param_groups[1]["weight_decay"] == 0.0  # wd_mult 0: biases and norms


def test_constant_weight_decay():
    scheduler = make(wd_style="constant", start_wd=0.05, end_wd=0.05)
    scheduler.step(300)
    assert scheduler.get_wd() == 0.05


def test_state_dict_round_trip_and_checkpoint_semantics():
    scheduler = make("cosine")
    scheduler.step(345)
    state = scheduler.state_dict()
    assert sorted(state) == sorted(
        [
            "max_lr",
            "lr_warmup_steps",
            "num_steps",
            "lr_decay_style",
            "lr_decay_steps",
            "min_lr",
            "start_wd",
            "end_wd",
            "wd_incr_style",
            "wd_incr_steps",
        ]
    )
    resumed = make("cosine")
    resumed.load_state_dict(state)
    assert resumed.num_steps == 345
    assert resumed.optimizer.param_groups == scheduler.optimizer.param_groups

    # By default the checkpoint's schedule wins; with override the constructor's does.
    taken = make("linear", max_lr=2.0)
    taken.load_state_dict(state)
    assert (taken.lr_decay_style, taken.max_lr) == ("cosine", MAX_LR)
    overridden = make("linear", max_lr=2.0, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    overridden.load_state_dict(state)
    assert (overridden.lr_decay_style, overridden.max_lr, overridden.num_steps) == ("linear", 2.0, 345)
    strict = make("linear", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(
        ValueError,
        match="learning rate decay style do not match: the checkpoint has 'cosine', "
        "this scheduler's lr_decay_style argument asks for 'linear'",
    ):
        strict.load_state_dict(state)


def iteration_based(warmup_iters, train_iters, global_batch_size=8, **overrides):
    """A scheduler built the way the trainer builds it for an iteration-based run (steps = iterations x batch)."""
    settings = dict(
        lr_decay_steps=train_iters * global_batch_size,
        wd_incr_steps=train_iters * global_batch_size,
        use_checkpoint_opt_param_scheduler=False,
    )
    scheduler = make(warmup=warmup_iters * global_batch_size, **{**settings, **overrides})
    scheduler.set_command_line_sources(
        {"lr_warmup_steps": "--lr-warmup-iters", "lr_decay_steps": "--train-iters", "wd_incr_steps": "--train-iters"},
        samples_per_iteration=global_batch_size,
    )
    return scheduler


def test_resume_mismatch_names_the_flags_and_speaks_iterations():
    saved = iteration_based(warmup_iters=10, train_iters=200).state_dict()
    with pytest.raises(ValueError) as error:
        iteration_based(warmup_iters=20, train_iters=200).load_state_dict(saved)
    message = str(error.value)
    assert "warmup iterations do not match" in message
    assert "the checkpoint has 10 iterations, the command line (--lr-warmup-iters) asks for 20 iterations" in message
    assert "--override-opt-param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message
    assert "samples" not in message  # 80 and 160 samples are not what the user typed

    # Raising --train-iters (the documented way to train further) changes the decay length: named the same way.
    with pytest.raises(
        ValueError,
        match="total number of iterations do not match: the checkpoint has 200 "
        r"iterations, the command line \(--train-iters\) asks for 400 iterations",
    ):
        iteration_based(warmup_iters=10, train_iters=400).load_state_dict(saved)

    # Either flag resolves it.
    overridden = iteration_based(warmup_iters=10, train_iters=400, override_opt_param_scheduler=True)
    overridden.load_state_dict(saved)
    assert overridden.lr_decay_steps == 400 * 8
    kept = iteration_based(warmup_iters=10, train_iters=400, use_checkpoint_opt_param_scheduler=True)
    kept.load_state_dict(saved)
    assert kept.lr_decay_steps == 200 * 8


def test_resume_mismatch_of_a_sample_based_run_speaks_samples():
    saved = make().state_dict()
    resumed = make(lr_decay_steps=2 * DECAY, use_checkpoint_opt_param_scheduler=False)
    resumed.set_command_line_sources({"lr_decay_steps": "--lr-decay-samples"})
    with pytest.raises(
        ValueError,
        match=r"the checkpoint has 1000 samples, the command line \(--lr-decay-samples\) "
        "asks for 2000 samples",
    ):
        resumed.load_state_dict(saved)


def test_old_checkpoint_key_names_are_read():
    old = {
        "start_lr": MAX_LR,
        "min_lr": MIN_LR,
        "warmup_iter": WARMUP,
        "end_iter": DECAY,
        "decay_style": "linear",
        "num_iters": 500,
    }
    scheduler = make()
    scheduler.load_state_dict(old)
    assert scheduler.num_steps == 500
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(closed_form_lr(500, "linear"))
    with pytest.raises(KeyError, match=r"has none of \['num_iters', 'num_steps'\]"):
        make().load_state_dict({k: v for k, v in old.items() if k != "num_iters"})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(min_lr=-1.0), "min_lr must be >= 0, got -1.0"),
        (dict(max_lr=0.05), r"max_lr \(0.05\) is below min_lr \(0.1\)"),
        (dict(init_lr=2.0), r"init_lr \(2.0\) is above max_lr \(1.0\)"),
        (dict(lr_decay_steps=0, lr_warmup_steps=0), "lr_decay_steps must be positive, got 0"),
        (dict(lr_warmup_steps=DECAY), r"lr_warmup_steps \(1000\) must be smaller than lr_decay_steps \(1000\)"),
        (dict(lr_decay_style="step"), "lr_decay_style 'step' is not one of"),
        (dict(lr_decay_style="WSD"), "lr_wsd_decay_style None is not one of"),
        (dict(lr_decay_style="WSD", lr_wsd_decay_style="linear"), "wsd_decay_steps must be in .* got None"),
        (dict(start_wd=0.2, end_wd=0.1), "need 0 <= start_wd <= end_wd"),
        (dict(wd_incr_style="step"), "wd_incr_style 'step' is not one of"),
        (dict(wd_incr_style="constant"), "'constant' needs start_wd == end_wd, got 0.0 and 0.1"),
        (dict(wd_incr_steps=0), "wd_incr_steps must be positive, got 0"),
        (dict(override_opt_param_scheduler=True), "both set; choose one"),
    ],
)
def test_bad_settings_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        make(**overrides)


def test_param_group_overrides_of_the_weight_decay_schedule():
    scheduler = make()
    group = {"start_wd": 0.5, "end_wd": 1.5, "wd_mult": 2.0}
    scheduler.optimizer.param_groups.append(group)
    scheduler.step(DECAY // 2)
    assert scheduler.get_wd() == pytest.approx(0.05)
    assert scheduler.get_wd(group) == pytest.approx(1.0)
    assert group["weight_decay"] == pytest.approx(2.0)  # the group's own schedule times its wd_mult


def test_param_group_override_helpers():
    from megatron.core.optimizer_param_scheduler import (
        ParamGroupOverride,
        combine_param_group_overrides,
        get_canonical_lr_for_logging,
        param_group_override_to_tuple,
    )

    assert param_group_override_to_tuple(None) is None
    assert param_group_override_to_tuple({"wd_mult": 0.0, "max_lr": 1.0}) == (("max_lr", 1.0), ("wd_mult", 0.0))
    assert param_group_override_to_tuple(ParamGroupOverride(max_lr=1.0, wd_mult=0.0)) == param_group_override_to_tuple(
        {"wd_mult": 0.0, "max_lr": 1.0}
    )
    assert combine_param_group_overrides([{"wd_mult": 0.0}, None, {"max_lr": 0.5, "wd_mult": 0.0}]) == {
        "wd_mult": 0.0,
        "max_lr": 0.5,
    }
    with pytest.raises(ValueError, match="conflicting parameter-group overrides: max_lr=0.5 and max_lr=0.25"):
        combine_param_group_overrides([{"max_lr": 0.5}, {"max_lr": 0.25}])
    groups = [{"lr": 0.1, "default_config": False}, {"lr": 0.2, "default_config": True}, {"lr": 0.3}]
    assert get_canonical_lr_for_logging(groups) == 0.2
    assert get_canonical_lr_for_logging(groups[:1]) is None
