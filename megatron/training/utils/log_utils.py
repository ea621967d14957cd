"""The job's progress log: ``<save>/progress.txt``, one line per event, appended across restarts."""

import os
from datetime import datetime

import torch.distributed as dist


def append_to_progress_log(string, barrier=True) -> None:
    """Append ``<time>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world size>\\t<string>`` to ``<save>/progress.txt``
    (rank 0 writes; with ``barrier`` every rank waits for it). Nothing is written without ``--save``."""
    from megatron.training.global_vars import get_args

    args = get_args()
    if args.save is None:
        return
    if barrier and dist.is_initialized():
        dist.barrier()
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    job_id = os.getenv("SLURM_JOB_ID", "")
    os.makedirs(args.save, exist_ok=True)
    with open(os.path.join(args.save, "progress.txt"), "a") as progress:
        progress.write(
            f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {job_id}\t# GPUs: {world_size}\t{string}\n"
        )
