"""Config dataclasses for result checking and straggler detection (and ``FaultInjectorConfig``, re-exported).

Field names and defaults are Megatron-LM 0.19's, the ``dest`` names of the matching command-line arguments.
"""

from dataclasses import dataclass
from typing import Literal

from megatron.core.fault_injector import FaultInjectorConfig


@dataclass(kw_only=True)
class RerunStateMachineConfig:
    """Settings of ``megatron.core.rerun_state_machine``: whether results are re-run to validate them or to
    report their variability, NaN and spiky-loss checks, and test-only error injection (one in
    ``error_injection_rate`` validations, 0 for never)."""

    error_injection_rate: int = 0
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = "transient_error"
    rerun_mode: Literal["disabled", "validate_results", "report_stats"] = "validate_results"
    check_for_nan_in_loss: bool = True
    check_for_spiky_loss: bool = False


@dataclass(kw_only=True)
class StragglerDetectionConfig:
    """Per-GPU throughput logging to find slow ranks: report the ``straggler_minmax_count`` fastest and slowest
    ranks; the detector can be switched at run time through port ``straggler_ctrlr_port``."""

    log_straggler: bool = False
    straggler_ctrlr_port: int = 65535
    straggler_minmax_count: int = 1
    disable_straggler_on_startup: bool = False


__all__ = ["FaultInjectorConfig", "RerunStateMachineConfig", "StragglerDetectionConfig"]
