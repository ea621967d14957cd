"""Building and wrapping stages for training from configs: the builders' build_distributed_models end to end on
one gloo rank, and dist_utils' refusals."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models import GPTModelBuilder, GPTModelConfig
from megatron.training.models.dist_utils import (
    _ddp_wrap,
    prepare_existing_model_chunks_for_distributed_training,
    to_empty_if_meta_device,
    unimodal_build_distributed_models,
)
from tests.unit_tests.test_utilities import Utils, run_distributed


def _config(**transformer_kwargs):
    transformer = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True, **transformer_kwargs
    )
    return GPTModelConfig(transformer=transformer, vocab_size=64, seq_length=8)


def _build_wrapped(bf16: bool):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    Utils.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    seen = []
    try:
        config = _config(bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
        config.pre_wrap_hooks = [lambda chunks: seen.append(("pre", type(chunks[0]).__name__)) or chunks]
        config.post_wrap_hooks = [lambda chunks: seen.append(("post", type(chunks[0]).__name__))]
        chunks = GPTModelBuilder(config).build_distributed_models(
            ProcessGroupCollection.use_mpu_process_groups(), ddp_config=DistributedDataParallelConfig()
        )
        inner = chunks[0].module
        return len(chunks), type(chunks[0]).__name__, type(inner).__name__, seen
    finally:
        Utils.destroy_model_parallel()


def test_gpt_builder_wraps_stages_and_runs_hooks():
    count, outer, inner, seen = run_distributed(1, _build_wrapped, False)[0]
    assert (count, outer, inner) == (1, DistributedDataParallel.__name__, "GPTModel")
    # The pre-wrap hook sees bare stages; a post-wrap hook returning None keeps the wrapped list.
    assert seen == [("pre", "GPTModel"), ("post", DistributedDataParallel.__name__)]
    assert run_distributed(1, _build_wrapped, True)[0][2] == Float16Module.__name__


def test_wrap_without_ddp_config_says_what_to_pass():
    with pytest.raises(ValueError, match="ddp_config is required when wrap_with_ddp is True.*wrap_with_ddp=False"):
        unimodal_build_distributed_models(lambda *a, **k: None, _config().transformer, SimpleNamespace())
    with pytest.raises(ValueError, match="ddp_config is required"):
        prepare_existing_model_chunks_for_distributed_training([], _config().transformer, SimpleNamespace())


def test_pre_wrap_hook_must_be_callable():
    groups = SimpleNamespace(pp=SimpleNamespace(size=lambda: 1, rank=lambda: 0))

    def build(pg, pre_process, post_process):
        return torch.nn.Linear(2, 2)

    with pytest.raises(TypeError, match="pre_wrap_hook must be a callable"):
        unimodal_build_distributed_models(build, _config().transformer, groups, wrap_with_ddp=False, pre_wrap_hook=3)


def test_both_fully_sharded_wrappers_are_refused():
    with pytest.raises(ValueError, match="use_megatron_fsdp and use_torch_fsdp2 cannot both be set"):
        _ddp_wrap(
            [],
            False,
            DistributedDataParallelConfig(),
            False,
            pg_collection=SimpleNamespace(),
            use_megatron_fsdp=True,
            use_torch_fsdp2=True,
        )


def test_meta_tensors_materialise_and_others_move():
    module = torch.nn.Linear(2, 2, device="meta")
    module.register_buffer("kept", torch.ones(2))
    result = to_empty_if_meta_device(module, device=torch.device("cpu"))
    assert result.weight.device.type == "cpu" and torch.equal(result.kept, torch.ones(2))
