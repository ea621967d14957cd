"""HybridModelConfig and HybridModelBuilder building a real Mamba/attention stage."""

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models import HybridModelBuilder, HybridModelConfig, MambaModelConfig
from tests.unit_tests.test_utilities import Utils, run_distributed


def _config(**kwargs):
    transformer = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        mamba_state_dim=8,
        mamba_head_dim=16,
        mamba_num_groups=2,
        is_hybrid_model=True,
        use_cpu_initialization=True,
    )
    return HybridModelConfig(transformer=transformer, vocab_size=64, seq_length=8, **kwargs)


def test_defaults_and_the_mamba_alias():
    config = _config()
    assert MambaModelConfig is HybridModelConfig
    assert config.position_embedding_type == "none"
    assert config.hybrid_layer_pattern is None and config.hybrid_stack_spec is None
    config.mamba_stack_spec = "spec"
    assert config.hybrid_stack_spec == "spec"


def _build(pattern):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    Utils.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    try:
        config = _config(hybrid_layer_pattern=pattern, should_pad_vocab=True)
        model = HybridModelBuilder(config).build_model(ProcessGroupCollection.use_mpu_process_groups())
        logits = model(torch.randint(0, 64, (1, 8)), torch.arange(8).unsqueeze(0), None)
        return type(model).__name__, tuple(logits.shape)
    finally:
        Utils.destroy_model_parallel()


def test_builder_builds_the_pattern():
    assert run_distributed(1, _build, "M*")[0] == ("HybridModel", (1, 8, 128))


def test_modelopt_stack_is_refused():
    builder = HybridModelBuilder(_config(restore_modelopt_state=True))
    with pytest.raises(ValueError, match=r"ModelOpt .*restore_modelopt_state=True"):
        builder._stack_spec()
