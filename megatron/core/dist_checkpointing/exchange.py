"""Collectives that keep ranks in agreement: every rank learns every other rank's result or failure.

An error found on one rank only (a bad shard, a full disk) must be raised on *every* rank at the same point,
otherwise the ranks that did not fail wait forever in the next collective. Each step that can fail locally
therefore ends in :func:`gather_and_raise_errors`. Without ``torch.distributed`` initialised these act on one rank.
"""

import traceback
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ..utils import get_current_device
from .core import CheckpointingException


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def collective_device() -> torch.device:
    """Where tensors for a collective must live: CPU for gloo, this rank's accelerator otherwise."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    return get_current_device()


def all_gather_objects(obj: Any, group=None) -> List[Any]:
    """Every rank's ``obj``, in rank order of ``group`` (one rank without torch.distributed)."""
    # A process group only exists under torch.distributed, so an explicit one always means a real collective.
    if group is None and not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def describe_error(error: BaseException) -> str:
    """The one-line message of a CheckpointingException, or the traceback of anything unexpected."""
    if isinstance(error, CheckpointingException):
        return str(error)
    return "".join(traceback.format_exception(error)).rstrip()


def raise_gathered_errors(errors: List[Optional[str]], what: str) -> None:
    """Raise one CheckpointingException naming every rank whose entry in ``errors`` is not None."""
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if not failed:
        return
    if len({error for _, error in failed}) == 1:
        ranks = ", ".join(str(rank) for rank, _ in failed)
        raise CheckpointingException(f"{what} failed on rank(s) {ranks}: {failed[0][1]}")
    details = "\n".join(f"  rank {rank}: {error}" for rank, error in failed)
    raise CheckpointingException(f"{what} failed on {len(failed)} ranks:\n{details}")


def gather_and_raise_errors(local_error: Optional[BaseException], what: str, group=None) -> None:
    """Collective over ``group``: raise on every rank if ``local_error`` is set on any rank."""
    message = None if local_error is None else describe_error(local_error)
    raise_gathered_errors(all_gather_objects(message, group), what)
