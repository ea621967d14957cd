"""Device helpers and small shared utilities.

Library code never calls ``.cuda()`` or ``torch.cuda.*`` directly: it asks these helpers, so every code path runs on
CPU (gloo) as well as on NVIDIA GPUs (nccl).
"""

import logging
import warnings
from contextlib import contextmanager
from functools import lru_cache
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def get_current_device() -> torch.device:
    """The device this rank computes on: its CUDA device when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_device_for_rank(local_rank: int) -> None:
    """Bind this process to its local GPU, when there is one."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_memory_mb() -> Optional[dict]:
    """Allocated, peak-allocated and reserved accelerator memory in MB (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    mb = 1024 * 1024
    return {
        "allocated": torch.cuda.memory_allocated() / mb,
        "max allocated": torch.cuda.max_memory_allocated() / mb,
        "reserved": torch.cuda.memory_reserved() / mb,
    }


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; raises when ``denominator`` does not divide ``numerator``."""
    if denominator == 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


@lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    """Emit ``message`` as a warning the first time it is seen in this process."""
    warnings.warn(message, stacklevel=3)


def print_rank_0(message: str) -> None:
    """Print from global rank 0 only (or always, before torch.distributed is initialised)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(message, flush=True)


def get_attr_wrapped_model(model, attr: str):
    """Get ``attr`` from ``model``, looking through wrappers (DDP, Float16Module) that keep the real model in ``.module``."""
    if isinstance(model, list):
        raise TypeError("get_attr_wrapped_model takes a single model chunk, not a list")
    while not hasattr(model, attr) and hasattr(model, "module"):
        model = model.module
    return getattr(model, attr)


def init_method_normal(sigma: float):
    """Init method drawing from N(0, sigma^2)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """Init method for output projections: N(0, (sigma / sqrt(multiplier * num_layers))^2), as in GPT-2/Megatron."""
    return init_method_normal(sigma / (multiplier * num_layers) ** 0.5)


@contextmanager
def layout_independent_init(config, stream_offset: int):
    """Draw the weights of the module built inside from its own CPU random stream when CPU initialisation is on.

    With ``config.use_cpu_initialization`` every full weight is created on the CPU and then split over tensor-parallel
    ranks. Seeding each module's draws from ``(base seed + stream_offset)`` — the embedding 0, transformer layer n
    (1-based, global) n, the output layer ``num_layers + 1`` — also makes the weights independent of which pipeline
    stage builds the module, so every TP/PP/VPP layout assembles the same model from the same seed. The base seed is
    the one last given to ``torch.manual_seed``; the caller's random state is restored afterwards.
    """
    if not config.use_cpu_initialization:
        yield
        return
    base_seed = torch.initial_seed()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base_seed + stream_offset)
        yield
