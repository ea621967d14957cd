"""Keeping the ranks of one model replica in agreement: the first rank's inputs, broadcast to all.

The engines' bookkeeping is replicated on every rank of the model-parallel group, so every rank must see the same
requests. ``Lockstep.share`` broadcasts a JSON-able value (prompts, sampling parameters) from the group's first rank
as UTF-8 bytes (never pickled).
"""

import json
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.utils import get_current_device


class Lockstep:
    """Broadcasts within the model-parallel group; a no-op on a single rank."""

    def __init__(self):
        self.group = None
        self.size = 1
        self.src = 0
        if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
            if parallel_state.get_data_parallel_world_size() > 1:
                raise ValueError(
                    f"inference engines run one model replica: data_parallel_size must be 1, got "
                    f"{parallel_state.get_data_parallel_world_size()} (launch tensor x pipeline ranks only)"
                )
            self.group = parallel_state.get_model_parallel_group()
            self.size = dist.get_world_size(self.group)
            self.src = dist.get_global_rank(self.group, 0)
        self.is_leader = self.size == 1 or dist.get_rank() == self.src
        self.device = (
            torch.device("cpu") if dist.is_initialized() and dist.get_backend() == "gloo" else (get_current_device())
        )

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def share(self, plan: Optional[dict]) -> dict:
        """The first rank's ``plan`` on every rank (the others pass None)."""
        if not self.distributed:
            return plan
        if self.is_leader:
            data = torch.tensor(list(json.dumps(plan).encode("utf-8")), dtype=torch.uint8, device=self.device)
            length = torch.tensor([data.numel()], dtype=torch.long, device=self.device)
        else:
            length = torch.empty(1, dtype=torch.long, device=self.device)
        dist.broadcast(length, src=self.src, group=self.group)
        if not self.is_leader:
            data = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=self.src, group=self.group)
        return plan if self.is_leader else json.loads(bytes(data.tolist()).decode("utf-8"))
