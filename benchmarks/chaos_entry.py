"""pretrain_gpt.py that SIGKILLs part of its own job at a chosen moment (used by benchmarks/chaos_resume.py).

Environment:
  CHAOS_TARGET     rank (this rank dies), launcher (torchrun dies), job (torchrun, every rank and worker die)
  CHAOS_PHASE      forward, backward, optimizer (at the start of that phase) or save (a delay into the save)
  CHAOS_ITERATION  the training iteration (1-based) whose phase triggers the kill; for save, the saved iteration
  CHAOS_RANK       the global rank that pulls the trigger
  CHAOS_DELAY_S    for save: seconds after the save starts (a random moment of the write)
  CHAOS_LOG        file that receives the wall-clock time of the kill
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch.distributed as dist  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.training import checkpointing  # noqa: E402
from megatron.training.global_vars import get_args  # noqa: E402
from tests.functional_tests.harness import descendants  # noqa: E402

TARGET = os.environ["CHAOS_TARGET"]
PHASE = os.environ["CHAOS_PHASE"]
ITERATION = int(os.environ["CHAOS_ITERATION"])
TRIGGER_RANK = int(os.environ["CHAOS_RANK"])
DELAY_S = float(os.environ.get("CHAOS_DELAY_S", "0"))


def _kill() -> None:
    Path(os.environ["CHAOS_LOG"]).write_text(repr(time.time()))
    launcher = os.getppid()
    if TARGET == "rank":
        victims = [os.getpid()]
    elif TARGET == "launcher":
        victims = [launcher]
    else:  # the whole job at once, as a scheduler's SIGKILL does
        victims = [launcher, *sorted(descendants(launcher) - {os.getpid()}), os.getpid()]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _triggers(phase: str) -> bool:
    return PHASE == phase and dist.get_rank() == TRIGGER_RANK and get_args().iteration + 1 == ITERATION


def forward_step(data_iterator, model):
    if _triggers("forward"):
        _kill()
    output, loss_func = pretrain_gpt.forward_step(data_iterator, model)
    if _triggers("backward") and output.requires_grad:
        output.register_hook(lambda grad: _kill())
    return output, loss_func


def _before_optimizer_step(optimizer, args, kwargs):
    if _triggers("optimizer"):
        _kill()


_save_checkpoint = checkpointing.save_checkpoint


def save_checkpoint(iteration, *args, **kwargs):
    if PHASE == "save" and iteration == ITERATION and dist.get_rank() == TRIGGER_RANK:
        threading.Timer(DELAY_S, _kill).start()
    return _save_checkpoint(iteration, *args, **kwargs)


if __name__ == "__main__":
    register_optimizer_step_pre_hook(_before_optimizer_step)
    checkpointing.save_checkpoint = save_checkpoint
    pretrain_gpt.main(forward_step)
