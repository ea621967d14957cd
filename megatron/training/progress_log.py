"""The job's accounting: the floating-point operations of each iteration (packed sequences counted by their real
lengths), the job's clock (``--exit-duration-in-mins`` counts from the program's start) and Megatron-LM's progress
log (``--log-progress``, ``<save>/progress.txt``), whose "Saved checkpoint" lines give this job's and the whole
run's throughput.
"""

import argparse
import os
import time
from datetime import datetime
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.public_api import public_api
from megatron.core import parallel_state
from megatron.core.utils import get_current_device
from megatron.training import flops
from megatron.training.global_vars import get_args
from megatron.training.utils import append_to_progress_log

# ---- floating-point operations of the running iteration --------------------------------------------------------


# Packed-sequence statistics of the running iteration (update_seqlen_stats_from_cu_seqlens), for exact FLOPs.
_SEQLEN_SQUARED_SUM: Optional[float] = None
_TOTAL_REAL_TOKENS: Optional[float] = None


@public_api("megatron.training.training")
def update_seqlen_stats_from_cu_seqlens(cu_seqlens):
    """Add a packed micro-batch's sequences (cumulative lengths ``cu_seqlens``, THD layout) to this iteration's
    statistics: the number of real tokens and the sum of squared lengths (attention FLOPs). None, or fewer than two
    offsets (no sequence), adds nothing."""
    global _SEQLEN_SQUARED_SUM, _TOTAL_REAL_TOKENS
    if cu_seqlens is None or cu_seqlens.numel() < 2:
        return
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
    _SEQLEN_SQUARED_SUM = (_SEQLEN_SQUARED_SUM or 0.0) + float((lengths * lengths).sum())
    _TOTAL_REAL_TOKENS = (_TOTAL_REAL_TOKENS or 0.0) + float(lengths.sum())


@public_api("megatron.training.training")
def consume_seqlen_stats_in_iteration() -> Tuple[Optional[float], Optional[float]]:
    """(real tokens, sum of squared sequence lengths) recorded this iteration, summed over the data-parallel ranks
    (Megatron's order), and reset; (None, None) when no packed sequences were recorded, without a collective. Before
    the model-parallel groups exist (a single process) the local statistics are returned."""
    global _SEQLEN_SQUARED_SUM, _TOTAL_REAL_TOKENS
    if _SEQLEN_SQUARED_SUM is None:
        return None, None
    stats = torch.tensor([_TOTAL_REAL_TOKENS, _SEQLEN_SQUARED_SUM], dtype=torch.float64, device=get_current_device())
    _SEQLEN_SQUARED_SUM = _TOTAL_REAL_TOKENS = None
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        dist.all_reduce(stats, group=parallel_state.get_data_parallel_group())
    return stats[0].item(), stats[1].item()


@public_api("megatron.training.training")
def num_floating_point_operations(args, batch_size, seqlen_squared_sum_in_batch=None, total_real_tokens_in_batch=None):
    """Training FLOPs of one iteration (megatron.training.flops' model) over ``batch_size`` sequences of
    --seq-length tokens, or, for packed sequences, over ``total_real_tokens_in_batch`` tokens whose attention
    covers ``seqlen_squared_sum_in_batch`` (the sum of squared sequence lengths)."""
    if seqlen_squared_sum_in_batch is None and total_real_tokens_in_batch is None:
        return flops.num_floating_point_operations(args, batch_size)
    # Either statistic alone replaces its own term; the other keeps the value of ``batch_size`` full sequences.
    if total_real_tokens_in_batch is None:
        total_real_tokens_in_batch = batch_size * args.seq_length
    if seqlen_squared_sum_in_batch is None:
        seqlen_squared_sum_in_batch = batch_size * args.seq_length**2
    # The count per sequence of s tokens is a*s + c*s^2 (linear layers and logits; attention scores); two
    # evaluations of the model at s = 1 and s = 2 give a and c.
    one, two = (
        flops.num_floating_point_operations(argparse.Namespace(**{**vars(args), "seq_length": s}), 1) for s in (1, 2)
    )
    per_square = (two - 2 * one) / 2
    per_token = one - per_square
    return per_token * total_real_tokens_in_batch + per_square * seqlen_squared_sum_in_batch


# ---- the job's clock and the progress log ----------------------------------------------------------------------

# When the program started (set_startup_timestamps can move it earlier): --exit-duration-in-mins counts from here.
_TRAIN_START_TIME = time.time()
_MAIN_ENTRY_TIME: Optional[float] = None
# Floating-point operations done before this job (those of the checkpoint it resumed from), for its throughput.
_JOB_START_FLOPS = 0.0


@public_api("megatron.training.training")
def set_startup_timestamps(program_start=None, main_entry=None):
    """Record when the program started (``time.time()`` values; default now) and when its main entry ran, so the
    start-up time is reported and --exit-duration-in-mins counts from the real start."""
    global _TRAIN_START_TIME, _MAIN_ENTRY_TIME
    _TRAIN_START_TIME = time.time() if program_start is None else program_start
    _MAIN_ENTRY_TIME = main_entry


def seconds_since_start() -> float:
    """Seconds since the program started (see :func:`set_startup_timestamps`)."""
    return time.time() - _TRAIN_START_TIME


def set_job_start_flops(value: float) -> None:
    """Record the floating-point operations of the checkpoint this job resumed from."""
    global _JOB_START_FLOPS
    _JOB_START_FLOPS = value


def _progress_log_path(args) -> str:
    return os.path.join(args.save, "progress.txt")


@public_api("megatron.training.training")
def get_start_time_from_progress_log():
    """(start time, floating-point operations done before it) of this run in the progress log: the first
    "Starting job" after the last change of world size, and the operations of the last checkpoint saved before
    it. The log's lines are tab-separated: time, job id, "# GPUs: N", event, then event fields."""
    args = get_args()
    start_time = start_flops = None
    latest_flops = 0.0
    with open(_progress_log_path(args)) as progress:
        for line in progress:
            fields = line.rstrip("\n").split("\t")
            world_size = int(fields[2].split(":")[1])
            if fields[3] == "Saved checkpoint":
                latest_flops = float(fields[7].split(":")[1])
            if world_size != args.world_size:
                start_time = start_flops = None
                continue
            if fields[3] == "Starting job" and start_time is None:
                start_time, start_flops = fields[0], latest_flops
    if start_time is None:
        raise ValueError(f"{_progress_log_path(args)} records no start of a job at world size {args.world_size}")
    return datetime.strptime(start_time, "%Y-%m-%d %H:%M:%S"), start_flops


@public_api("megatron.training.training")
def compute_throughputs_and_append_to_progress_log(iteration, num_floating_point_operations_so_far):
    """Append "Saved checkpoint" with this job's and the run's throughput (TFLOP/s per device), the operations and
    the tokens so far to the progress log (--log-progress)."""
    args = get_args()
    if args.save is None:
        return
    start_time, start_flops = get_start_time_from_progress_log()
    elapsed_job = time.time() - _TRAIN_START_TIME
    elapsed_run = (datetime.now() - start_time).total_seconds()
    job_flops = num_floating_point_operations_so_far - _JOB_START_FLOPS
    job_throughput = job_flops / max(elapsed_job, 1e-9) / 1e12 / args.world_size
    run_throughput = (
        (num_floating_point_operations_so_far - start_flops) / max(elapsed_run, 1e-9) / 1e12 / (args.world_size)
    )
    tokens_so_far = args.consumed_train_samples * args.seq_length
    append_to_progress_log(
        args.save,
        f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job_throughput:.1f} TFLOP/s/GPU\t"
        f"Cumulative throughput: {run_throughput:.1f} TFLOP/s/GPU\t"
        f"Floating-point operations: {num_floating_point_operations_so_far:.2e}\t"
        f"Tokens (in billions): {tokens_so_far / 10**9:.2f}",
    )
