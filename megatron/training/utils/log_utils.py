"""Logging helpers of Megatron-LM's training loop: warning and module filters, the logging set-up, the job's
progress log (``<save>/progress.txt``, one line per event, appended across restarts) and a logged barrier."""

import logging
import os
from datetime import datetime
from functools import partial
from logging import Filter, LogRecord
from typing import Callable, Optional, Union

import torch

from megatron.core._rank_utils import safe_get_rank, safe_get_world_size
from megatron.training.utils.common_utils import print_rank_0

logger = logging.getLogger(__name__)


def warning_filter(record: LogRecord) -> bool:
    """Drop WARNING records (and keep every other level)."""
    return record.levelno != logging.WARNING


def module_filter(record: LogRecord, modules_to_filter: list) -> bool:
    """Drop records of loggers whose name starts with one of ``modules_to_filter``."""
    return not any(record.name.startswith(module) for module in modules_to_filter)


def add_filter_to_all_loggers(filter: Union[Filter, Callable[[LogRecord], bool]]) -> None:
    """Add ``filter`` to the root logger and to every logger created so far."""
    logging.getLogger().addFilter(filter)
    for name in logging.root.manager.loggerDict:
        logging.getLogger(name).addFilter(filter)


def setup_logging(
    logging_level: Optional[int] = None,
    filter_warning: bool = True,
    modules_to_filter: Optional[list] = None,
    set_level_for_all_loggers: bool = False,
) -> None:
    """Set the root logger's level (``logging_level``, else $MEGATRON_LOGGING_LEVEL, else INFO), and that of the
    ``megatron.bridge`` loggers (of every logger with ``set_level_for_all_loggers``); then add the filters asked for:
    WARNING records out (``filter_warning``) and records of ``modules_to_filter`` out."""
    level = logging.INFO
    if os.getenv("MEGATRON_LOGGING_LEVEL") is not None:
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if logging_level is not None:
        level = logging_level
    logger.info(f"Setting logging level to {level}")
    logging.getLogger().setLevel(level)
    for name in logging.root.manager.loggerDict:
        if set_level_for_all_loggers or name.startswith("megatron.bridge"):
            logging.getLogger(name).setLevel(level)
    if filter_warning:
        add_filter_to_all_loggers(warning_filter)
    if modules_to_filter:
        add_filter_to_all_loggers(partial(module_filter, modules_to_filter=modules_to_filter))


def append_to_progress_log(save_dir: Optional[str], string: str, barrier: bool = True) -> None:
    """Append ``<time>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world size>\\t<string>`` to ``<save_dir>/progress.txt``
    (rank 0 writes; with ``barrier`` every rank waits first). Nothing is written without a ``save_dir``."""
    if save_dir is None:
        return
    if barrier and torch.distributed.is_initialized():
        torch.distributed.barrier()
    if safe_get_rank() != 0:
        return
    os.makedirs(save_dir, exist_ok=True)
    job_id = os.getenv("SLURM_JOB_ID", "")
    with open(os.path.join(save_dir, "progress.txt"), "a+") as progress:
        progress.write(
            f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {job_id}\t# GPUs: {safe_get_world_size()}\t"
            f"{string}\n"
        )


def barrier_and_log(string: str) -> None:
    """Wait for every rank, then print ``[string] datetime: <now>`` on rank 0."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    print_rank_0(f"[{string}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} ")
