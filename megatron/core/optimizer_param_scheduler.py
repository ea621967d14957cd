"""OptimizerParamScheduler: learning-rate warm-up and decay, and weight-decay increment, set on every param group.

Steps count *samples* in Megatron-LM (the trainer calls ``step(increment=global_batch_size)`` after each successful
iteration), but any unit works as long as warm-up, decay and increment lengths use the same one. The constructor
applies step 0, so with warm-up the first update uses ``init_lr``.

Learning rate at step n (W = warm-up steps, D = decay steps; per-group ``max_lr``/``min_lr`` override the defaults):

- warm-up (W > 0 and n <= W): ``init_lr + (max_lr - init_lr) * n / W``;
- ``constant``: ``max_lr``; past D: ``min_lr``;
- ``inverse-square-root``: ``max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))``;
- otherwise ``min_lr + coeff * (max_lr - min_lr)`` with r = (n - W) / (D - W) and coeff ``1 - r`` (linear),
  ``(cos(pi r) + 1) / 2`` (cosine), or for ``WSD`` 1 until D - wsd_decay_steps, then over the decay window
  (progress p) ``1 - p`` (linear), ``(cos(pi p) + 1) / 2`` (cosine), ``2 * 0.5^p - 1`` (exponential) or
  ``1 - sqrt(p)`` (minus_sqrt).

Weight decay: ``end_wd`` past the increment steps; else ``start_wd + coeff * (end_wd - start_wd)`` with coeff = r
(linear) or ``(cos(pi (1 - r)) + 1) / 2`` (cosine), r = n / wd_incr_steps; ``constant`` needs start == end.
Each group gets ``lr * lr_mult`` and ``wd * wd_mult``; a group's own ``max_lr`` / ``min_lr`` / ``start_wd`` /
``end_wd`` (a :class:`ParamGroupOverride`) replace the scheduler's for that group.
"""

import logging
import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, TypedDict

from megatron.core.utils import print_rank_0

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

logger = logging.getLogger(__name__)


class ParamGroupOverride(TypedDict, total=False):
    """Values a parameter group sets for itself instead of the scheduler's (or the optimizer's) defaults.

    The scheduler reads ``max_lr``, ``min_lr``, ``start_wd``, ``end_wd`` and ``wd_mult`` from each group; any other
    key (e.g. ``eps``, ``lr_mult``) becomes a key of the torch optimizer's param group. ``optimizer`` (Megatron's
    per-group optimizer choice) is declared so that it takes part in matching saved groups on load.
    Example: ``ParamGroupOverride(min_lr=1e-4, wd_mult=0.0)``.
    """

    max_lr: float
    min_lr: float
    start_wd: float
    end_wd: float
    wd_mult: float
    optimizer: str


def param_group_override_to_tuple(
    param_group_override: Optional[ParamGroupOverride],
) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """The override as a hashable, order-independent key: its items sorted by name (None stays None)."""
    if param_group_override is None:
        return None
    return tuple(sorted(param_group_override.items()))


def combine_param_group_overrides(
    param_group_overrides: List[Optional[ParamGroupOverride]],
) -> ParamGroupOverride:
    """Merge the overrides of every ParamKey a parameter matches; two that set one key to different values
    contradict each other and are refused."""
    combined: ParamGroupOverride = {}
    for override in param_group_overrides:
        for key, value in (override or {}).items():
            if key in combined and combined[key] != value:
                raise ValueError(
                    f"conflicting parameter-group overrides: {key}={combined[key]!r} and {key}={value!r} both match "
                    "one parameter; make the ParamKeys disjoint or give them the same value"
                )
            combined[key] = value
    return combined


def get_canonical_lr_for_logging(param_groups: List[dict]) -> Optional[float]:
    """The learning rate to log: that of the first group on the default schedule (``default_config``), None if
    every group overrides its schedule."""
    for group in param_groups:
        if group.get("default_config", False):
            return group.get("lr")
    return None


# Attributes counted in steps (samples in Megatron-LM), reported in iterations for iteration-based runs.
_STEP_COUNTS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every param group of ``optimizer`` (see the module docstring).

    ``use_checkpoint_opt_param_scheduler`` (default) takes the schedule stored in a checkpoint on load;
    ``override_opt_param_scheduler`` keeps the constructor's values instead; with neither, the two must agree.
    """

    def __init__(
        self,
        optimizer: "MegatronOptimizer",
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: Optional[bool] = True,
        override_opt_param_scheduler: Optional[bool] = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.lr_decay_style = lr_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        # Where the constructor's values came from, for resume-mismatch messages (see set_command_line_sources).
        self._command_line_flags: Dict[str, str] = {}
        self._samples_per_iteration: Optional[int] = None
        self._validate()
        self.step(0)
        print_rank_0(f"> learning rate decay style: {self.lr_decay_style}")

    def _validate(self) -> None:
        if self.min_lr < 0.0:
            raise ValueError(f"OptimizerParamScheduler: min_lr must be >= 0, got {self.min_lr}")
        if self.max_lr < self.min_lr:
            raise ValueError(f"OptimizerParamScheduler: max_lr ({self.max_lr}) is below min_lr ({self.min_lr})")
        if self.init_lr > self.max_lr:
            raise ValueError(f"OptimizerParamScheduler: init_lr ({self.init_lr}) is above max_lr ({self.max_lr})")
        if self.lr_decay_steps <= 0:
            raise ValueError(f"OptimizerParamScheduler: lr_decay_steps must be positive, got {self.lr_decay_steps}")
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(
                f"OptimizerParamScheduler: lr_warmup_steps ({self.lr_warmup_steps}) must be smaller than "
                f"lr_decay_steps ({self.lr_decay_steps})"
            )
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"OptimizerParamScheduler: lr_decay_style {self.lr_decay_style!r} is not one of {LR_DECAY_STYLES}"
            )
        if self.lr_decay_style == "WSD":
            if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(
                    f"OptimizerParamScheduler: lr_wsd_decay_style {self.lr_wsd_decay_style!r} is not one of "
                    f"{WSD_DECAY_STYLES} (needed by lr_decay_style 'WSD')"
                )
            if self.wsd_decay_steps is None or not 0 < self.wsd_decay_steps <= self.lr_decay_steps:
                raise ValueError(
                    f"OptimizerParamScheduler: wsd_decay_steps must be in (0, lr_decay_steps={self.lr_decay_steps}] "
                    f"for lr_decay_style 'WSD', got {self.wsd_decay_steps}"
                )
        if self.start_wd < 0.0 or self.end_wd < self.start_wd:
            raise ValueError(
                f"OptimizerParamScheduler: need 0 <= start_wd <= end_wd, got start_wd={self.start_wd}, "
                f"end_wd={self.end_wd}"
            )
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(
                f"OptimizerParamScheduler: wd_incr_style {self.wd_incr_style!r} is not one of {WD_INCR_STYLES}"
            )
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(
                f"OptimizerParamScheduler: wd_incr_style 'constant' needs start_wd == end_wd, got {self.start_wd} "
                f"and {self.end_wd}; use 'linear' or 'cosine' to change weight decay"
            )
        if self.wd_incr_style != "constant" and self.wd_incr_steps <= 0:
            raise ValueError(f"OptimizerParamScheduler: wd_incr_steps must be positive, got {self.wd_incr_steps}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "OptimizerParamScheduler: override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are "
                "both set; choose one"
            )

    def get_wd(self, param_group: Optional[dict] = None) -> float:
        """Weight decay at the current step (before the group's ``wd_mult``); ``param_group`` may override
        ``start_wd`` / ``end_wd``."""
        group = param_group or {}
        start_wd = group.get("start_wd", self.start_wd)
        end_wd = group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def get_lr(self, param_group: Dict) -> float:
        """Learning rate of ``param_group`` at the current step (before its ``lr_mult``)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n, warmup, decay = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(warmup)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
        ratio = float(n - warmup) / float(decay - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff(n)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, n: int) -> float:
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if n <= anneal_start:
            return 1.0
        progress = float(n - anneal_start) / float(self.wsd_decay_steps)
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - progress
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * progress) + 1.0)
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, progress) - 1.0
        return 1.0 - math.sqrt(progress)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` steps and set every group's ``lr`` and ``weight_decay``."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self) -> Dict:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def set_command_line_sources(self, flags: Dict[str, str], samples_per_iteration: Optional[int] = None) -> None:
        """Name where the constructor's values came from, so that a resume mismatch speaks the user's terms.

        ``flags`` maps an attribute (``lr_warmup_steps``, ``lr_decay_steps``, ``wd_incr_steps``, ``max_lr``, ...)
        to the command-line flag that set it. ``samples_per_iteration`` (the global batch size of an
        iteration-based run, whose step counts are iterations x global batch size) reports step counts in
        iterations; without it a trainer's step counts are samples.
        """
        self._command_line_flags = dict(flags)
        self._samples_per_iteration = samples_per_iteration

    def _describe(self, value, attribute: str) -> str:
        """``value`` of ``attribute`` in the units the user gave it."""
        if attribute not in _STEP_COUNTS:
            return repr(value)
        if self._samples_per_iteration:
            iterations = value / self._samples_per_iteration
            return f"{int(iterations) if iterations == int(iterations) else iterations:g} iterations"
        return f"{value} {'samples' if self._command_line_flags else 'steps'}"

    def _mismatch_message(self, name: str, attribute: str, cls_value, sd_value) -> str:
        flag = self._command_line_flags.get(attribute)
        source = f"the command line ({flag})" if flag else f"this scheduler's {attribute} argument"
        return (
            f"OptimizerParamScheduler: {name} do not match: the checkpoint has {self._describe(sd_value, attribute)}, "
            f"{source} asks for {self._describe(cls_value, attribute)}. Pass --override-opt-param-scheduler "
            "(override_opt_param_scheduler=True) to train with the new value, or "
            "--use-checkpoint-opt_param-scheduler (use_checkpoint_opt_param_scheduler=True) to keep the "
            "checkpoint's schedule."
        )

    def _check_and_set(self, cls_value, sd_value, name: str, attribute: str):
        """Which of the constructor's and the checkpoint's value of ``attribute`` to use (see the class
        docstring)."""
        if self.override_opt_param_scheduler:
            print_rank_0(f" > overriding {name} value to {cls_value}")
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(self._mismatch_message(name, attribute, cls_value, sd_value))
        print_rank_0(f" > using checkpoint value {sd_value} for {name}")
        return sd_value

    def load_state_dict(self, state_dict: Dict) -> None:
        """Restore the schedule and position; also reads the key names of older Megatron checkpoints."""

        def pick(*keys):
            for key in keys:
                if key in state_dict:
                    return state_dict[key]
            raise KeyError(f"OptimizerParamScheduler state dict has none of {list(keys)}; it has {sorted(state_dict)}")

        def check_and_set(attribute, name, *keys):
            setattr(self, attribute, self._check_and_set(getattr(self, attribute), pick(*keys), name, attribute))

        check_and_set("max_lr", "learning rate", "start_lr", "max_lr")
        check_and_set("min_lr", "minimum learning rate", "min_lr")
        check_and_set("lr_warmup_steps", "warmup iterations", "warmup_iter", "warmup_steps", "lr_warmup_steps")
        check_and_set("lr_decay_steps", "total number of iterations", "end_iter", "decay_steps", "lr_decay_steps")
        check_and_set("lr_decay_style", "learning rate decay style", "decay_style", "lr_decay_style")
        if "start_wd" in state_dict:
            check_and_set("start_wd", "start weight decay", "start_wd")
            check_and_set("end_wd", "end weight decay", "end_wd")
            check_and_set("wd_incr_steps", "total number of weight decay iterations", "wd_incr_steps")
            check_and_set("wd_incr_style", "weight decay incr style", "wd_incr_style")
        # The position always comes from the checkpoint (the point of resuming).
        self.num_steps = 0
        self.step(increment=pick("num_iters", "num_steps"))
