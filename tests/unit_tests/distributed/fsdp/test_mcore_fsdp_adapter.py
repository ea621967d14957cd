"""megatron.core.distributed.fsdp: Megatron's import paths and constructor, and the FSDP fields of
DistributedDataParallelConfig: each bad value or combination is one error naming both fields and the fix."""

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


def test_wrapping_without_use_megatron_fsdp_is_one_clear_error():
    from megatron.core.distributed.fsdp import FullyShardedDataParallel

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"needs DistributedDataParallelConfig\(use_megatron_fsdp=True\).*"):
        FullyShardedDataParallel(config, DistributedDataParallelConfig(), torch.nn.Linear(2, 2))


def test_grad_comm_dtype_without_sharded_gradients_is_refused():
    from megatron.core.distributed.fsdp import FullyShardedDataParallel

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim",
        use_distributed_optimizer=True,
        megatron_fsdp_grad_comm_dtype=torch.bfloat16,
    )
    with pytest.raises(ValueError, match=r"megatron_fsdp_grad_comm_dtype with data_parallel_sharding_strategy='optim'"):
        FullyShardedDataParallel(config, ddp_config, torch.nn.Linear(2, 2))


FSDP = dict(use_megatron_fsdp=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(data_parallel_sharding_strategy="optim_grads_params"),
            r"data_parallel_sharding_strategy='optim_grads_params' is read only by Megatron FSDP: set "
            r"use_megatron_fsdp=True.*use_distributed_optimizer=True",
        ),
        (dict(fsdp_double_buffer=True), r"fsdp_double_buffer=True is read only by Megatron FSDP"),
        (dict(megatron_fsdp_main_grads_dtype=torch.float32), r"megatron_fsdp_main_grads_dtype=torch.float32 is read"),
        (dict(megatron_fsdp_grad_comm_dtype=torch.bfloat16), r"megatron_fsdp_grad_comm_dtype=torch.bfloat16 is read"),
        (dict(FSDP, data_parallel_sharding_strategy="zero3"), r"data_parallel_sharding_strategy='zero3' is not one of"),
        (
            dict(FSDP, data_parallel_sharding_strategy="optim_grads"),
            r"'optim_grads' with use_distributed_optimizer=False: .*; set use_distributed_optimizer=True",
        ),
        (
            dict(FSDP, use_distributed_optimizer=True),
            r"'no_shard' with use_distributed_optimizer=True: .*use data_parallel_sharding_strategy='optim'",
        ),
        (
            dict(FSDP, data_parallel_sharding_strategy="optim", use_distributed_optimizer=True, fsdp_double_buffer=1),
            r"fsdp_double_buffer=True with data_parallel_sharding_strategy='optim': .*use that strategy or drop",
        ),
        (
            dict(FSDP, megatron_fsdp_main_params_dtype=torch.bfloat16),
            r"megatron_fsdp_main_params_dtype=torch.bfloat16: not supported yet.*leave it at torch.float32",
        ),
        (dict(FSDP, megatron_fsdp_main_grads_dtype=torch.int8), r"megatron_fsdp_main_grads_dtype=torch.int8 must be"),
    ],
)
def test_ddp_config_refuses_bad_fsdp_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedDataParallelConfig(**kwargs)


def test_use_custom_fsdp_is_megatrons_old_name():
    assert DistributedDataParallelConfig(use_custom_fsdp=True).use_megatron_fsdp


def _double_buffer_notice():
    import warnings

    from tests.unit_tests.distributed import fsdp_test_helpers as fh
    from megatron.core.utils import warn_once
    from tests.unit_tests.models import gpt_test_helpers as gpt

    warn_once.cache_clear()  # the pool's worker may have warned in an earlier test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fh.wrap(gpt.build_model(1, False, "gpt2"), "optim_grads_params", fsdp_double_buffer=True)
    return [str(w.message) for w in caught if "fsdp_double_buffer" in str(w.message)]


def test_double_buffer_is_accepted_and_says_it_changes_nothing():
    from tests.unit_tests.test_utilities import run_distributed

    (messages,) = run_distributed(1, _double_buffer_notice)
    assert len(messages) == 1 and "has no effect here" in messages[0] and "NCCL user-buffer" in messages[0]
