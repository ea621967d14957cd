"""Config dataclasses shared by the training and inference containers: random seeds, profiling, and
``torch.distributed`` start-up.

Field names and defaults are Megatron-LM 0.19's; most are the ``dest`` of the command-line argument of the
same name (``seed`` is ``--seed``), and mean what that flag means.
"""

import os
from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class RNGConfig:
    """Seeding of python, numpy and torch, and which CUDA RNG tracker is used."""

    seed: int = 1234
    # The Transformer Engine tracker (needed for CUDA graphs); the inference tracker is for serving.
    te_rng_tracker: bool = False
    inference_rng_tracker: bool = False
    # Different initial weights on each data-parallel rank (normally they are identical).
    data_parallel_random_init: bool = False


@dataclass(kw_only=True)
class ProfilingConfig:
    """Profiling: nsys or the PyTorch profiler over steps ``profile_step_start`` to ``profile_step_end`` on
    ``profile_ranks``, and CUDA memory-history snapshots. ``use_nsys_profiler`` is the ``--profile`` flag."""

    use_nsys_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    use_pytorch_profiler: bool = False
    pytorch_profiler_collect_shapes: bool = False
    pytorch_profiler_collect_callstack: bool = False
    pytorch_profiler_collect_chakra: bool = False
    profile_ranks: list[int] = field(default_factory=lambda: [])
    record_memory_history: bool = False
    memory_snapshot_path: str = "snapshot.pickle"
    record_shapes: bool = False
    nvtx_ranges: bool = False


@dataclass(kw_only=True)
class DistributedInitConfig:
    """How ``torch.distributed`` and the process groups are started: backend, timeouts, rank order, FSDP
    flavour, SHARP, and the NCCL flight recorder (``flight_recorder_*`` set the matching ``TORCH_*`` variables).

    ``local_rank`` defaults to the launcher's ``LOCAL_RANK`` environment variable (0 when unset), read when the
    config is created. ``use_gloo_process_groups`` is off with ``--disable-gloo-process-groups``.
    """

    distributed_backend: Literal["nccl", "gloo"] = "nccl"
    distributed_timeout_minutes: int = 10
    align_grad_reduce: bool = True
    local_rank: int = field(default_factory=lambda: int(os.getenv("LOCAL_RANK", "0")))
    lazy_mpu_init: bool = False
    use_megatron_fsdp: bool = False
    use_torch_fsdp2: bool = False
    nccl_communicator_config_path: str | None = None
    use_tp_pp_dp_mapping: bool = False
    use_gloo_process_groups: bool = True
    use_sharp: bool = False
    sharp_enabled_group: Literal["dp", "dp_replica"] | None = None
    high_priority_stream_groups: list[str] | None = field(default_factory=list)
    distributed_timeout_seconds_after_init: int | None = None
    flight_recorder_dump_path: str | None = None
    flight_recorder_trace_buffer_size: int = 2000
    flight_recorder_dump_on_timeout: bool = True
    flight_recorder_include_stack_trace: bool = False
    flight_recorder_include_only_active: bool = True
    flight_recorder_extra_dump_on_exec: bool = True
    disable_jit_fuser: bool = False
