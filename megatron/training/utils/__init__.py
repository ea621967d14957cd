"""Helpers of the training application (Megatron-LM's ``megatron.training.utils``): printing on the right rank,
unwrapping model chunks, norms and reductions, memory reports, batches and masks, the progress log."""

import importlib

from megatron.core.public_api import public_names
from megatron.training.utils.common_utils import (
    ALL_MODULE_WRAPPER_CLASSNAMES,
    average_losses_across_data_parallel_group,
    calc_dtensor_params_l2_norm,
    calc_params_l2_norm,
    get_batch_on_this_tp_rank,
    get_blend_and_blend_per_split,
    get_device_arch_version,
    get_local_rank_preinit,
    get_ltor_masks_and_position_ids,
    get_nvtx_range,
    has_nvrx_checkpointing_async_support,
    has_nvrx_installed,
    is_first_or_last_pipeline_stage,
    is_hybrid_model,
    is_last_rank,
    is_rank0,
    logical_and_across_model_parallel_group,
    print_params_min_max_norm,
    print_rank_0,
    print_rank_last,
    reduce_max_stat_across_model_parallel_group,
    report_memory,
    to_empty_if_meta_device,
    unwrap_model,
    update_use_dist_ckpt,
    warn_rank_0,
)
from megatron.training.utils.log_utils import append_to_progress_log
from megatron.training.utils.utils import start_memory_history_recording


# Names that moved up to a module that imports this one; PEP 562 looks them up there on first use, so the old path
# keeps working without an upward import.
_MOVED = {"check_adlr_autoresume_termination": "megatron.training.checkpointing"}


def __getattr__(name):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = public_names(globals(), _MOVED)
