"""Check that data-parallel replicas hold bit-identical parameters (a diagnostic for silent divergence)."""

import hashlib
import logging
from typing import List

import torch

from megatron.core.public_api import public_api
from megatron.core import parallel_state
from megatron.core.utils import get_current_device, get_pg_size

logger = logging.getLogger(__name__)


def _tensor_hash(tensor: torch.Tensor) -> int:
    # The raw bytes, so a difference in the last bit counts; 8 bytes of SHA-256 fit an int64 all_gather.
    data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


@public_api("megatron.core.utils")
def check_param_hashes_across_dp_replicas(model: List[torch.nn.Module], cross_check: bool = False) -> bool:
    """Whether every parameter is bit-identical on all the data-parallel replicas that should hold it.

    Dense parameters are compared over the data-parallel group, expert parameters (``allreduce=False``) over the
    expert data-parallel group; mismatches are logged by name. With ``cross_check`` the hashes are compared across
    all ranks of those groups at once (every replica against every other, not only against DP rank 0).
    """
    groups = {
        True: parallel_state.get_data_parallel_group(),
        False: parallel_state.get_expert_data_parallel_group(),
    }
    local = {True: [], False: []}
    for chunk_index, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            local[getattr(param, "allreduce", True)].append((f"{chunk_index}.{name}", _tensor_hash(param.data)))
    all_match = True
    for dense, params in local.items():
        group = groups[dense]
        size = get_pg_size(group)
        if size == 1 or not params:
            continue
        hashes = torch.tensor([h for _, h in params], dtype=torch.int64, device=get_current_device())
        gathered = [torch.empty_like(hashes) for _ in range(size)]
        torch.distributed.all_gather(gathered, hashes, group=group)
        stacked = torch.stack(gathered).cpu()
        reference = stacked if cross_check else stacked[:1]
        for i, (name, _) in enumerate(params):
            column = stacked[:, i]
            if not bool((column.unsqueeze(0) == reference[:, i].unsqueeze(1)).all()):
                all_match = False
                logger.error("parameter %s differs across data-parallel replicas: hashes %s", name, column.tolist())
    return all_match
