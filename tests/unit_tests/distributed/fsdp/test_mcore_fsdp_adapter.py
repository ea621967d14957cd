"""megatron.core.distributed.fsdp: Megatron's import paths exist; constructing the FSDP wrapper is refused."""

import inspect

import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig


def test_import_paths_are_megatrons():
    from megatron.core.distributed import FullyShardedDataParallel as from_package
    from megatron.core.distributed.fsdp import FullyShardedDataParallel as from_fsdp
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    assert from_package is from_fsdp is FullyShardedDataParallel
    assert list(inspect.signature(FullyShardedDataParallel.__init__).parameters) == [
        "self",
        "config",
        "ddp_config",
        "module",
        "fsdp_unit_modules",
        "disable_bucketing",
        "device",
        "pg_collection",
    ]


def test_constructing_the_wrapper_is_one_clear_error():
    from megatron.core.distributed.fsdp import FullyShardedDataParallel

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(
        ValueError, match=r"not supported yet: Megatron FSDP \(FullyShardedDataParallel.*own issue \(FSDP\)"
    ):
        FullyShardedDataParallel(config, DistributedDataParallelConfig(), torch.nn.Linear(2, 2))
