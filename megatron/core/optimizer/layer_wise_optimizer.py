"""The layer-wise distributed optimizer (Megatron's ``dist_muon``): each parameter is stepped whole on one rank of
its data-parallel group and then broadcast to the others.

Sharding whole parameters instead of flat buffer ranges (as :class:`DistributedOptimizer` does) is what Muon needs:
Newton-Schulz reads a complete matrix, so a matrix must not be cut between ranks. Gradients are all-reduced as
under plain DDP, so every rank computes the same global gradient norm and clipping factor; only the owner of a
parameter runs its update and holds its optimizer state. Owners are chosen greedily, largest parameter first onto
the least-loaded rank, which balances the Newton-Schulz work.

Checkpoints stay layout-free: before saving, each owner broadcasts its state, so every rank describes the full
state exactly as the non-distributed optimizer would (a transient copy, dropped again at the next step); after
loading, each rank keeps the state of the parameters it owns.
"""

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups_config import ProcessGroupCollection

__all__ = ["LayerWiseDistributedOptimizer", "is_managed_by_layer_wise_optimizer"]

_OWNER_ATTRIBUTE = "layer_wise_owner_rank"


def is_managed_by_layer_wise_optimizer(param: torch.Tensor) -> bool:
    """Whether ``param`` is stepped by a LayerWiseDistributedOptimizer (on the rank recorded on it)."""
    return getattr(param, _OWNER_ATTRIBUTE, None) is not None


def _assign_owners(params: List[torch.Tensor], size: int) -> List[int]:
    """Owner rank of each parameter: largest first onto the least-loaded rank (ties: lowest rank, then the
    parameter's position), the same on every rank."""
    loads = [0] * size
    owners = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        rank = min(range(size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += params[index].numel()
    return owners


class LayerWiseDistributedOptimizer(ChainedOptimizer):
    """Chains ``optimizers`` (Muon and its scalar optimizer, dense and expert) and shards their parameters whole
    over each one's data-parallel group (``optimizer.data_parallel_group``; ``pg_collection.dp_cp`` otherwise)."""

    def __init__(
        self,
        optimizers: List[MegatronOptimizer],
        config: OptimizerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
        init_state_fn_list: Optional[List] = None,
    ):
        super().__init__(optimizers)
        self.config = config
        if init_state_fn_list is not None:
            for optimizer, init_state_fn in zip(optimizers, init_state_fn_list):
                optimizer.init_state_fn = init_state_fn
        self._shards = []
        for optimizer in self.chained_optimizers:
            group = getattr(optimizer, "data_parallel_group", None)
            if group is None and pg_collection is not None:
                group = pg_collection.dp_cp
            params = optimizer.get_parameters()
            size = dist.get_world_size(group) if group is not None else 1
            owners = _assign_owners(params, size)
            for param, owner in zip(params, owners):
                setattr(param, _OWNER_ATTRIBUTE, owner)
            rank = dist.get_rank(group) if group is not None else 0
            self._shards.append((optimizer, group, rank, params, owners))

    def owned_parameters(self) -> List[torch.Tensor]:
        """The parameters this rank steps."""
        return [p for _, _, rank, params, owners in self._shards for p, o in zip(params, owners) if o == rank]

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self._drop_state_of_others()
        success = True
        for optimizer, group, rank, params, owners in self._shards:
            # Torch optimizers skip parameters without a gradient: the others' parameters are not stepped here.
            held = {}
            for param, owner in zip(params, owners):
                if owner != rank and param.grad is not None:
                    held[param] = param.grad
                    param.grad = None
            success = optimizer.step_with_ready_grads() and success
            for param, grad in held.items():
                param.grad = grad
            self._broadcast_from_owners(params, owners, group)
            copy_to_model = getattr(optimizer, "_copy_main_params_to_model_params", None)
            if copy_to_model is not None:
                copy_to_model()
        return success

    def _broadcast_from_owners(self, tensors: List[torch.Tensor], owners: List[int], group) -> None:
        if group is None or dist.get_world_size(group) == 1:
            return
        for owner in range(dist.get_world_size(group)):
            mine = [tensor.data for tensor, o in zip(tensors, owners) if o == owner]
            if not mine:
                continue
            flat = _flatten_dense_tensors(mine)
            dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group)
            for tensor, value in zip(mine, _unflatten_dense_tensors(flat, mine)):
                tensor.copy_(value)

    def _drop_state_of_others(self) -> None:
        for optimizer, _, rank, params, owners in self._shards:
            for param, owner in zip(params, owners):
                if owner != rank:
                    optimizer.optimizer.state.pop(param, None)

    @torch.no_grad()
    def _gather_state(self) -> None:
        """Give every rank the full optimizer state (each owner broadcasts the state of its parameters)."""
        for optimizer, group, rank, params, owners in self._shards:
            optimizer.init_state_fn(optimizer.optimizer, optimizer.config)
            state = optimizer.optimizer.state
            names = sorted({name for param in params for name in state[param]})
            for name in names:
                tensors = [state[param][name] for param in params]
                floats = [t if t.dtype == torch.float32 else t.float() for t in tensors]
                self._broadcast_from_owners(floats, owners, group)
                for tensor, value in zip(tensors, floats):
                    if tensor is not value:
                        tensor.copy_(value)

    def state_dict(self):
        self._gather_state()
        return super().state_dict()

    def sharded_state_dict(self, model_sharded_state_dict: Dict, is_loading: bool = False, **kwargs):
        if not is_loading:
            self._gather_state()
        return super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._drop_state_of_others()

    def state_bytes(self) -> int:
        self._drop_state_of_others()
        return super().state_bytes()
