"""Model configs and containers built from parsed Megatron-LM flags (gpt/hybrid_config_from_args,
inference_cfg_container_from_args)."""

import pytest

from megatron.training.config import InferenceConfigContainer
from megatron.training.config_from_args import (
    gpt_config_from_args,
    hybrid_config_from_args,
    inference_cfg_container_from_args,
)
from megatron.training.models import GPTModelConfig, HybridModelConfig
from tests.unit_tests.training.test_arguments import validated


def test_gpt_config_from_flags():
    args = validated(
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--rotary-base", "500"
    )
    config = gpt_config_from_args(args)
    assert isinstance(config, GPTModelConfig)
    assert (config.vocab_size, config.should_pad_vocab, config.seq_length) == (100, True, args.max_position_embeddings)
    assert (config.position_embedding_type, config.rotary_base) == ("rope", 500)
    assert config.share_embeddings_and_output_weights is False
    assert config.hidden_size == args.hidden_size  # read through to the TransformerConfig built from the flags


def test_padded_vocab_size_is_used_as_given():
    args = validated()
    args.padded_vocab_size = 256
    config = gpt_config_from_args(args)
    assert (config.vocab_size, config.should_pad_vocab) == (256, False)


def test_missing_vocab_size_names_both_flags():
    args = validated()
    args.vocab_size = None
    with pytest.raises(ValueError, match="--vocab-size .* or --padded-vocab-size"):
        gpt_config_from_args(args)


def test_model_config_class_must_fit_the_builder():
    with pytest.raises(TypeError, match="model_config_cls must be GPTModelConfig or a subclass"):
        gpt_config_from_args(validated(), model_config_cls=HybridModelConfig)


def test_hybrid_config_and_inference_container():
    args = validated()
    args.hybrid_layer_pattern = "M*"
    hybrid = hybrid_config_from_args(args)
    assert isinstance(hybrid, HybridModelConfig) and hybrid.hybrid_layer_pattern == "M*"
    container = inference_cfg_container_from_args(args)
    assert isinstance(container, InferenceConfigContainer) and isinstance(container.model, HybridModelConfig)
    assert container.checkpoint.load_optim is not args.no_load_optim
