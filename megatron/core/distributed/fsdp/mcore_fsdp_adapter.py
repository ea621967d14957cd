"""``FullyShardedDataParallel``, Megatron FSDP's model wrapper: importable, refused when constructed.

Fully sharded data parallelism (parameters, gradients and optimizer state sharded over the data-parallel group) is
a separate issue of this project and not built yet. The class exists with Megatron's constructor so that code that
imports it, or only mentions it (``isinstance`` checks, type hints, unwrapping tuples), runs unchanged; building one
raises a single error before anything is allocated or communicated. ``DistributedDataParallelConfig`` refuses its
FSDP fields (``use_megatron_fsdp``, ``data_parallel_sharding_strategy``, ...) the same way.
"""

from typing import List, Optional

import torch

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class FullyShardedDataParallel(MegatronModule):
    """Megatron FSDP's wrapper (``config, ddp_config, module, fsdp_unit_modules, disable_bucketing, device,
    pg_collection``); not supported yet: constructing it raises ``ValueError``."""

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        fsdp_unit_modules: Optional[List[torch.nn.Module]] = None,
        disable_bucketing: bool = False,
        device: Optional[torch.device] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        raise ValueError(
            "not supported yet: Megatron FSDP (FullyShardedDataParallel, --use-megatron-fsdp) is not built; fully "
            "sharded data parallelism is its own issue (FSDP). Wrap the model in "
            "megatron.core.distributed.DistributedDataParallel, with use_distributed_optimizer=True to shard the "
            "optimizer state"
        )
