"""Where a SLURM job (``srun``) says this process sits: SLURM_NTASKS marks a job, SLURM_PROCID / SLURM_LOCALID
give the global and the node-local rank. Each reader returns None outside a job or when its variable is unset."""

import os
from typing import Optional


def is_slurm_job() -> bool:
    return "SLURM_NTASKS" in os.environ


def _slurm_int(variable: str) -> Optional[int]:
    if not is_slurm_job() or variable not in os.environ:
        return None
    return int(os.environ[variable])


def resolve_slurm_rank() -> Optional[int]:
    return _slurm_int("SLURM_PROCID")


def resolve_slurm_world_size() -> Optional[int]:
    return _slurm_int("SLURM_NTASKS")


def resolve_slurm_local_rank() -> Optional[int]:
    return _slurm_int("SLURM_LOCALID")
