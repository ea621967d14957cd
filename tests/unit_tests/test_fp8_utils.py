"""megatron.core.fp8_utils: Megatron's names and signatures, False parameter predicates (parameters are never FP8
here), no-op contexts and hooks without FP8, the recipe and region with it, the pure helpers, and one clear error
wherever FP8 parameters are asked for."""

import inspect
import types

import pytest
import torch

from megatron.core import fp8_utils
from megatron.core.enums import Fp8Recipe
from megatron.core.fp8.quantization import quantize_tensorwise
from megatron.core.fp8.recipe import active_fp8_region
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

# Megatron-Core 0.19's public functions of fp8_utils and their parameters.
MEGATRON_SIGNATURES = {
    "is_float8tensor": ["tensor"],
    "is_mxfp8tensor": ["tensor"],
    "is_grouped_tensor": ["tensor"],
    "is_grouped_tensor_with_quantized_storage": ["tensor"],
    "is_grouped_mxfp8tensor": ["tensor"],
    "get_grouped_quantized_members": ["tensor", "create_if_missing"],
    "copy_tensor_to_quantized_param": ["param", "src"],
    "modify_grouped_tensor_rowwise_storage": ["tensor", "new_storage"],
    "dequantize_fp8_tensor": ["fp8_tensor"],
    "get_fp8_align_size": ["fp8_recipe"],
    "is_column_parallel_linear": ["module"],
    "is_row_parallel_linear": ["module"],
    "modify_underlying_storage": ["tensor", "new_raw_data"],
    "quantize_param_shard": [
        "model_params",
        "main_params",
        "start_offsets",
        "data_parallel_group",
        "fsdp_shard_model_params",
    ],
    "correct_amax_history_if_needed": ["model"],
    "post_all_gather_processing": ["model_params"],
    "is_first_last_bf16_layer": ["config", "layer_no"],
    "is_mxfp8_output_proj_active": ["config"],
    "get_fp8_recipe": ["config"],
    "get_fp8_context": ["config", "layer_no", "is_init"],
    "prepare_model_for_fp8_inference": ["model"],
}


def _config(**overrides):
    return TransformerConfig(**{"num_layers": 6, "hidden_size": 8, "num_attention_heads": 2, **overrides})


def test_public_functions_have_megatrons_signatures():
    for name, params in MEGATRON_SIGNATURES.items():
        assert list(inspect.signature(getattr(fp8_utils, name)).parameters) == params, name
    assert fp8_utils.HAVE_TE is False


def test_no_tensor_is_quantized():
    plain, param = torch.ones(4), torch.nn.Parameter(torch.ones(4))
    fp8_dtype = torch.ones(4).to(torch.float8_e4m3fn)  # a torch float8 dtype is not a Transformer Engine FP8 tensor
    predicates = (
        fp8_utils.is_float8tensor,
        fp8_utils.is_mxfp8tensor,
        fp8_utils.is_grouped_tensor,
        fp8_utils.is_grouped_tensor_with_quantized_storage,
        fp8_utils.is_grouped_mxfp8tensor,
    )
    assert not any(predicate(t) for predicate in predicates for t in (plain, param, fp8_dtype))


def test_contexts_and_recipe_are_no_ops_while_fp8_is_off():
    config = _config()
    assert fp8_utils.get_fp8_recipe(config) is None
    for kwargs in ({}, {"layer_no": 3}, {"is_init": True}):
        with fp8_utils.get_fp8_context(config, **kwargs):
            pass
    assert fp8_utils.is_mxfp8_output_proj_active(config) is False


def test_recipe_and_context_with_fp8():
    config = _config(fp8="hybrid", fp8_recipe="delayed", fp8_margin=1, fp8_amax_history_len=4)
    recipe = fp8_utils.get_fp8_recipe(config)
    assert (recipe.fp8_format, recipe.recipe, recipe.margin, recipe.amax_history_len) == ("hybrid", "delayed", 1, 4)
    assert (recipe.forward_dtype, recipe.backward_dtype) == (torch.float8_e4m3fn, torch.float8_e5m2)
    with fp8_utils.get_fp8_context(config, layer_no=2):
        assert active_fp8_region().recipe == recipe
    assert active_fp8_region() is None
    bf16_ends = _config(fp8="e4m3", fp8_recipe="tensorwise", first_last_layers_bf16=True)
    with fp8_utils.get_fp8_context(bf16_ends, layer_no=0):
        assert active_fp8_region() is None
    q = quantize_tensorwise(torch.tensor([1.0, -2.0]), torch.float8_e4m3fn)
    assert torch.equal(fp8_utils.dequantize_fp8_tensor(q), torch.tensor([1.0, -2.0]))


def test_asking_for_fp8_parameters_is_one_clear_error():
    asks = types.SimpleNamespace(fp8="hybrid", fp8_param=True)
    with pytest.raises(ValueError, match=r"get_fp8_context\(is_init=True\) with fp8_param=True\); FP8 here quanti"):
        fp8_utils.get_fp8_context(asks, is_init=True)
    with pytest.raises(ValueError, match=r"not supported yet: FP8 .*prepare_model_for_fp8_inference"):
        fp8_utils.prepare_model_for_fp8_inference(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"dequantize_fp8_tensor expects a QuantizedTensor, got a Tensor"):
        fp8_utils.dequantize_fp8_tensor(torch.ones(2))
    with pytest.raises(ValueError, match=r"modify_underlying_storage needs a Transformer Engine FP8 parameter"):
        fp8_utils.modify_underlying_storage(torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match=r"quantize_param_shard got 1 FP8 model parameters"):
        fp8_utils.quantize_param_shard([torch.ones(2)], [torch.ones(2)], [(0, 2)], None)
    with pytest.raises(ValueError, match=r"expects a Transformer Engine GroupedTensor with quantized storage"):
        fp8_utils.get_grouped_quantized_members(torch.ones(2))
    with pytest.raises(ValueError, match=r"modify_grouped_tensor_rowwise_storage expects .* GroupedTensor, got a"):
        fp8_utils.modify_grouped_tensor_rowwise_storage(torch.ones(2), torch.ones(2))


def test_per_step_hooks_do_nothing_without_fp8_parameters():
    fp8_utils.quantize_param_shard([], [], [], None)
    fp8_utils.correct_amax_history_if_needed([torch.nn.Linear(2, 2)])
    fp8_utils.post_all_gather_processing([torch.nn.Parameter(torch.ones(2))])
    param = torch.nn.Parameter(torch.zeros(2, 3))
    fp8_utils.copy_tensor_to_quantized_param(param, torch.arange(6.0))
    assert torch.equal(param.data, torch.arange(6.0).view(2, 3))


def test_pure_helpers():
    assert fp8_utils.get_fp8_align_size(Fp8Recipe.mxfp8) == 32
    assert [fp8_utils.get_fp8_align_size(r) for r in (Fp8Recipe.delayed, Fp8Recipe.tensorwise)] == [16, 16]
    config = _config(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    assert [fp8_utils.is_first_last_bf16_layer(config, n) for n in (-1, 0, 1, 3, 4, 5)] == [
        False,
        True,
        False,
        False,
        True,
        True,
    ]
    assert not fp8_utils.is_first_last_bf16_layer(_config(), 0)
    mp = ModelParallelConfig(perform_initialization=False)
    column = ColumnParallelLinear(4, 4, config=mp, init_method=torch.nn.init.zeros_)
    row = RowParallelLinear(
        4, 4, config=mp, init_method=torch.nn.init.zeros_, bias=False, input_is_parallel=True, skip_bias_add=False
    )
    assert (fp8_utils.is_column_parallel_linear(column), fp8_utils.is_row_parallel_linear(column)) == (True, False)
    assert (fp8_utils.is_column_parallel_linear(row), fp8_utils.is_row_parallel_linear(row)) == (False, True)
    assert not fp8_utils.is_column_parallel_linear(torch.nn.Linear(2, 2))
