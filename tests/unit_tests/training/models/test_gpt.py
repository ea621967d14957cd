"""GPTModelConfig (fields, TransformerConfig proxy, finalize checks) and GPTModelBuilder building real stages."""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models import GPTModelBuilder, GPTModelConfig
from megatron.training.models.base import ModelConfigError
from megatron.training.models.gpt import default_layer_spec
from tests.unit_tests.test_utilities import Utils, run_distributed


def _transformer(**kwargs):
    return TransformerConfig(
        **{"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "use_cpu_initialization": True, **kwargs}
    )


def test_proxy_reads_and_writes_the_transformer_but_keeps_own_fields():
    transformer = _transformer()
    config = GPTModelConfig(transformer=transformer, vocab_size=100)
    assert config.hidden_size == 16
    config.hidden_size = 32
    assert transformer.hidden_size == 32 and "hidden_size" not in config.__dict__
    config.seq_length = 64
    assert config.__dict__["seq_length"] == 64 and not hasattr(transformer, "seq_length")
    with pytest.raises(AttributeError, match="Neither GPTModelConfig nor TransformerConfig has any attribute 'nope'"):
        config.nope


def test_finalize_names_the_cuda_graph_setting():
    config = GPTModelConfig(transformer=_transformer(), vocab_size=100)
    config.transformer.cuda_graph_impl = "local"
    with pytest.raises(ModelConfigError, match=r"cuda_graph_impl='local'.*use_te_rng_tracker=True"):
        config.finalize()


def test_finalize_names_the_uneven_virtual_pipeline():
    transformer = _transformer(
        num_layers=6,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    message = r"3 layers per pipeline stage .* virtual_pipeline_model_parallel_size=2"
    with pytest.raises(ModelConfigError, match=message):
        GPTModelConfig(transformer=transformer, vocab_size=100).finalize()


def test_heterogeneous_config_is_refused_with_the_flag():
    with pytest.raises(ValueError, match="heterogeneous layer configurations.*--heterogeneous-layers-config-path"):
        HeterogeneousTransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2)


def test_modelopt_spec_is_refused():
    config = GPTModelConfig(transformer=_transformer(), vocab_size=100, restore_modelopt_state=True)
    config.use_arbitrary_attention_mask = True
    with pytest.raises(ValueError, match=r"ModelOpt .*restore_modelopt_state=True"):
        default_layer_spec(config, None)


def _build(config_kwargs):
    Utils.initialize_model_parallel()
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1)

    try:
        config = GPTModelConfig(transformer=_transformer(), seq_length=8, **config_kwargs)
        model = GPTModelBuilder(config).build_model(ProcessGroupCollection.use_mpu_process_groups())
        tokens = torch.randint(0, 100, (1, 8))
        logits = model(tokens, torch.arange(8).unsqueeze(0), None)
        return type(model).__name__, model.vocab_size, (model.pre_process, model.post_process), tuple(logits.shape)
    finally:
        Utils.destroy_model_parallel()


def test_build_model_pads_the_vocabulary_when_asked():
    name, vocab, stages, shape = run_distributed(1, _build, {"vocab_size": 100, "should_pad_vocab": True})[0]
    assert name == GPTModel.__name__ and vocab == 128 and stages == (True, True) and shape == (1, 8, 128)
    assert run_distributed(1, _build, {"vocab_size": 100})[0][1] == 100


def _build_without_vocab():
    Utils.initialize_model_parallel()
    from megatron.core.process_groups_config import ProcessGroupCollection

    try:
        GPTModelBuilder(GPTModelConfig(transformer=_transformer())).build_model(
            ProcessGroupCollection.use_mpu_process_groups()
        )
    except ModelConfigError as error:
        return str(error)
    finally:
        Utils.destroy_model_parallel()


def test_build_model_without_vocab_size_says_what_to_set():
    assert "GPTModelConfig.vocab_size must be configured" in run_distributed(1, _build_without_vocab)[0]
