"""This process's rank and the world size before (or without) torch.distributed: the process group if there is one,
else the launcher's variables (torchrun's RANK / WORLD_SIZE, then SLURM's), else rank 0 of 1 with a warning."""

import logging
import os
import warnings
from typing import Any

import torch

from megatron.core._slurm_utils import resolve_slurm_rank, resolve_slurm_world_size


def safe_get_rank() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    try:
        if "RANK" in os.environ:
            return int(os.environ["RANK"])
        slurm_rank = resolve_slurm_rank()
    except (ValueError, TypeError):  # a malformed variable: rank 0, as Megatron-Core
        return 0
    if slurm_rank is not None:
        return slurm_rank
    warnings.warn("Could not determine rank from torch.distributed, RANK, or SLURM_PROCID. Defaulting to rank 0.")
    return 0


def safe_get_world_size() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    slurm_world_size = resolve_slurm_world_size()
    if slurm_world_size is not None:
        return slurm_world_size
    warnings.warn(
        "Could not determine world size from torch.distributed, WORLD_SIZE, or SLURM_NTASKS. "
        "Defaulting to world size 1."
    )
    return 1


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """``logger.log(*args, **kwargs)`` on one rank only (``rank``, 0 by default)."""
    if safe_get_rank() == rank:
        logger.log(*args, **kwargs)
