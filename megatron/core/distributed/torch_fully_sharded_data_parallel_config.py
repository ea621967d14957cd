"""TorchFullyShardedDataParallelConfig: the DDP config plus what torch FSDP2 (``fully_shard``) takes."""

from dataclasses import dataclass
from typing import Union

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig


@dataclass
class TorchFullyShardedDataParallelConfig(DistributedDataParallelConfig):
    """Configuration of :class:`~megatron.core.distributed.TorchFullyShardedDataParallel`.

    The inherited DDP fields keep their meaning where FSDP2 has one; ``use_distributed_optimizer`` and
    ``overlap_param_gather`` must stay off, since FSDP2 already shards parameters, gradients and optimizer state.
    """

    reshard_after_forward: Union[bool, int] = True
    """What ``fully_shard`` does with a layer's gathered parameters after its forward: True frees them (gathered
    again for backward), False keeps them until backward, an int re-shards them onto groups of that many ranks
    (torch's ``reshard_after_forward``)."""

    def __post_init__(self):
        super().__post_init__()
        if self.use_distributed_optimizer:
            raise ValueError(
                "TorchFullyShardedDataParallelConfig: use_distributed_optimizer=True cannot be combined with torch "
                "FSDP2, which already shards the optimizer state over the data-parallel ranks; leave it False"
            )
        value = self.reshard_after_forward
        if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 1):
            raise ValueError(
                f"TorchFullyShardedDataParallelConfig: reshard_after_forward must be True, False or a positive "
                f"number of ranks, got {value!r}"
            )
