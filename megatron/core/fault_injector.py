"""Settings for fault-injection tests (hangs and crashes injected on chosen ranks by nvidia-resiliency-ext).

Only the config dataclass is here, so that configs naming it can be read and written; this project has no fault
injector (nvidia-resiliency-ext is not a dependency). Field names are Megatron-Core 0.19's.
"""

from dataclasses import dataclass


@dataclass
class FaultInjectorConfig:
    """Which ranks get faults (a comma-separated ``fault_injector_ranks`` list, or ``fault_injector_num_ranks``
    picked at random), which faults (``fault_injector_fault_types`` such as ``"hang,crash"`` with
    ``fault_injector_fault_probabilities``), and when: after ``fault_injector_fault_delay`` seconds (counted from
    the end of iteration ``fault_injector_delay_start_iteration`` when given), or a random delay with mean
    ``fault_injector_mtti_seconds`` plus ``fault_injector_offset_seconds``, seeded by ``fault_injector_seed``."""

    fault_injector_ranks: str | None = None
    fault_injector_num_ranks: int | None = None
    fault_injector_fault_types: str | None = None
    fault_injector_fault_probabilities: str | None = None
    fault_injector_fault_delay: float | None = None
    fault_injector_delay_start_iteration: int | None = None
    fault_injector_mtti_seconds: float | None = None
    fault_injector_offset_seconds: float | None = None
    fault_injector_seed: int | None = None
