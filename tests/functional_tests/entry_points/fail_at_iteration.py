"""pretrain_gpt.py with an injected failure: one rank raises in its forward step at a chosen iteration.

Environment: FAIL_AT_ITERATION (1-based training iteration), FAIL_ON_RANK (global rank, default the last one),
FAIL_WITH ("crash" raises RuntimeError, "input" raises ValueError as a bad-input check would), FAIL_LOG (a file
that receives the wall-clock time of the failure).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch.distributed as dist  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.training.global_vars import get_args  # noqa: E402

FAIL_AT_ITERATION = int(os.environ["FAIL_AT_ITERATION"])
FAIL_WITH = os.environ.get("FAIL_WITH", "crash")


def failing_forward_step(data_iterator, model):
    fail_on_rank = int(os.environ.get("FAIL_ON_RANK", dist.get_world_size() - 1))
    if get_args().iteration + 1 == FAIL_AT_ITERATION and dist.get_rank() == fail_on_rank:
        if "FAIL_LOG" in os.environ:
            Path(os.environ["FAIL_LOG"]).write_text(repr(time.time()))
        message = f"injected failure at iteration {FAIL_AT_ITERATION}"
        raise ValueError(message) if FAIL_WITH == "input" else RuntimeError(message)
    return pretrain_gpt.forward_step(data_iterator, model)


if __name__ == "__main__":
    pretrain_gpt.main(failing_forward_step)
