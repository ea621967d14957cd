"""The harness's ``tests/unit_tests/test_utilities.py``: Megatron's ``Utils`` interface on one gloo process.

Megatron's own file starts NCCL on a GPU per rank. Here the process group is gloo with world size 1 (the harness
runs one process); a test that asks for more ranks, or for a parallel layout that needs more ranks, is skipped,
the same way for both packages under test.
"""

import os
from datetime import timedelta

import pytest
import torch

import megatron.core.parallel_state as ps

_NVTE_VARS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


class TestModel(torch.nn.Module):
    """A stack of linear layers; the last one may be marked as a shared embedding."""

    __test__ = False

    def __init__(self, input_dim: int, output_dim: int, num_layers: int, bias: bool, shared_embedding: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(input_dim, output_dim, bias) for _ in range(num_layers)])
        if shared_embedding:
            self.layers[-1].weight.shared_embedding = True


def clear_nvte_env_vars():
    for name in _NVTE_VARS:
        os.environ.pop(name, None)


def _skip_unless_one_rank(ranks: int, what: str):
    if ranks > 1:
        pytest.skip(f"{what} needs {ranks} ranks; the CPU harness runs one process")


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    inited = False
    store = None

    @staticmethod
    def initialize_distributed():
        clear_nvte_env_vars()
        _skip_unless_one_rank(Utils.world_size, "this test")
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            store = torch.distributed.PrefixStore("default_pg", torch.distributed.HashStore())
            Utils.store = store
            torch.distributed.init_process_group(
                backend="gloo", world_size=1, rank=0, store=store, timeout=timedelta(minutes=1)
            )
        Utils.inited = True

    @staticmethod
    def set_world_size(world_size=None, rank=None):
        Utils.world_size = 1 if world_size is None else world_size
        _skip_unless_one_rank(Utils.world_size, "this test")
        Utils.rank = int(os.environ.get("LOCAL_RANK", "0")) if rank is None else rank

    @staticmethod
    def destroy_model_parallel():
        clear_nvte_env_vars()
        if not Utils.inited:
            return
        ps.destroy_model_parallel()
        Utils.inited = False

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ):
        clear_nvte_env_vars()
        ranks = tensor_model_parallel_size * pipeline_model_parallel_size * kwargs.get("context_parallel_size", 1)
        expert_ranks = kwargs.get("expert_model_parallel_size", 1) * (kwargs.get("expert_tensor_parallel_size") or 1)
        _skip_unless_one_rank(max(ranks, expert_ranks), "this parallel layout")
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(
            tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, **kwargs
        )
        Utils.inited = True

    @staticmethod
    def pretrain_config_from_global_args(args, model_class):
        # Megatron-LM's path, which both sides have (megatron-lite serves these names from config_from_args).
        from megatron.training import argument_utils

        builders = {"gpt": argument_utils.gpt_config_from_args, "hybrid": argument_utils.hybrid_config_from_args}
        if model_class not in builders:
            raise ValueError(f"model_class must be 'gpt' or 'hybrid', got {model_class!r}")
        return argument_utils.pretrain_cfg_container_from_args(args, builders[model_class](args))

    @staticmethod
    def fake_initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
    ):
        """Set the parallel sizes (rank 0 of each) without creating groups."""
        ps.set_tensor_model_parallel_world_size(tensor_model_parallel_size)
        ps.set_tensor_model_parallel_rank(0)
        ps.set_expert_model_parallel_world_size(expert_model_parallel_size)
        ps.set_expert_model_parallel_rank(0)
        if virtual_pipeline_model_parallel_size is not None:
            ps.set_virtual_pipeline_model_parallel_world_size(virtual_pipeline_model_parallel_size)
        ps.set_virtual_pipeline_model_parallel_rank(0)
        ps.set_pipeline_model_parallel_world_size(pipeline_model_parallel_size)
