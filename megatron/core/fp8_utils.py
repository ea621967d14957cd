"""Megatron-Core's FP8 helpers (``megatron.core.fp8_utils``) over this project's pure-PyTorch FP8 training.

Megatron implements these on Transformer Engine's quantized tensor classes. Here FP8 is a property of the linear
layers' GEMMs (:mod:`megatron.core.fp8`, :mod:`megatron.core.tensor_parallel.fp8_linear`): parameters stay in their
high precision (``fp8_param`` / ``--fp8-param-gather`` is not built), so the parameter predicates are False, the
per-step parameter hooks have nothing to do, ``get_fp8_recipe`` returns a :class:`Fp8ScalingRecipe` and
``get_fp8_context`` the region a layer's linears run FP8 in. Whatever needs an FP8 parameter raises one
``ValueError`` saying so.
"""

from contextlib import nullcontext
from typing import List

import torch

from megatron.core.enums import Fp8Recipe
from megatron.core.fp8.context import fp8_layer_context, is_first_last_bf16_layer  # noqa: F401  (Megatron's path)
from megatron.core.fp8.quantization import QuantizedTensor
from megatron.core.fp8.recipe import Fp8ScalingRecipe
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

HAVE_TE = False
"""Whether Transformer Engine's FP8 classes are in use (never, here); Megatron's tests read this flag."""

_NO_FP8 = (
    "not supported yet: FP8 parameters ({what}); FP8 here quantises the linear layers' GEMM operands and keeps "
    "parameters in high precision. Leave fp8_param unset"
)


def _refuse(what: str) -> ValueError:
    return ValueError(_NO_FP8.format(what=what))


# ---- what kind of tensor: never a quantized one here ---------------------------------------------------------------


def is_float8tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a Parameter's data) is a Transformer Engine FP8 tensor: always False here."""
    return False


def is_mxfp8tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a Transformer Engine MXFP8 tensor: always False here."""
    return False


def is_grouped_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a Transformer Engine GroupedTensor: always False here."""
    return False


def is_grouped_tensor_with_quantized_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a GroupedTensor holding quantized storage: always False here."""
    return False


def is_grouped_mxfp8tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a GroupedTensor of MXFP8 members: always False here."""
    return False


def get_grouped_quantized_members(tensor: torch.Tensor, *, create_if_missing: bool = False) -> List[torch.Tensor]:
    """The per-expert views of a grouped quantized tensor; there are none here, so this always refuses."""
    raise ValueError(
        "get_grouped_quantized_members expects a Transformer Engine GroupedTensor with quantized storage, got a "
        f"{type(tensor).__name__}; only FP8 grouped expert weights have members"
    )


def copy_tensor_to_quantized_param(param: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``param``'s storage (reshaped to it); for an unquantized parameter a plain copy."""
    destination = param.data if isinstance(param, torch.nn.Parameter) else param
    destination.copy_(src.view(destination.shape))


def modify_grouped_tensor_rowwise_storage(tensor: torch.Tensor, new_storage: torch.Tensor) -> None:
    """Move a GroupedTensor onto ``new_storage``; there are no GroupedTensors here, so this always refuses."""
    raise ValueError(
        f"modify_grouped_tensor_rowwise_storage expects a Transformer Engine GroupedTensor, got a "
        f"{type(tensor).__name__}"
    )


def dequantize_fp8_tensor(fp8_tensor) -> torch.Tensor:
    """The high-precision (float32) value of a quantised tensor (:class:`QuantizedTensor`)."""
    if not isinstance(fp8_tensor, QuantizedTensor):
        raise ValueError(f"dequantize_fp8_tensor expects a QuantizedTensor, got a {type(fp8_tensor).__name__}")
    return fp8_tensor.dequantize()


# ---- pure helpers --------------------------------------------------------------------------------------------------


def get_fp8_align_size(fp8_recipe: Fp8Recipe) -> int:
    """Rows an FP8 GEMM input must be padded to: 32 for MXFP8 (its 32-element scaling blocks), else 16."""
    return 32 if fp8_recipe == Fp8Recipe.mxfp8 else 16


def is_column_parallel_linear(module) -> bool:
    """Whether ``module`` is a column-parallel linear layer."""
    return isinstance(module, ColumnParallelLinear)


def is_row_parallel_linear(module) -> bool:
    """Whether ``module`` is a row-parallel linear layer."""
    return isinstance(module, RowParallelLinear)


def is_mxfp8_output_proj_active(config) -> bool:
    """Whether the output layer runs in MXFP8 (``fp8_output_proj`` with an MXFP8 recipe): never, here."""
    return False


# ---- hooks the optimizer and DDP call every step: nothing to do for unquantized parameters ----------------------


def modify_underlying_storage(tensor: torch.Tensor, new_raw_data: torch.Tensor):
    """Point an FP8 parameter at new raw storage (DDP's contiguous buffer); refused, as no parameter is FP8."""
    raise _refuse("modify_underlying_storage needs a Transformer Engine FP8 parameter")


def quantize_param_shard(model_params, main_params, start_offsets, data_parallel_group, fsdp_shard_model_params=None):
    """Cast the distributed optimizer's fp32 shards into FP8 model parameters: nothing to do when there are none."""
    if len(model_params) != 0:
        raise _refuse(f"quantize_param_shard got {len(model_params)} FP8 model parameters")


def correct_amax_history_if_needed(model: List[torch.nn.Module]):
    """Repair FP8 amax histories after in-place copies (Transformer Engine 1.x only): nothing to repair here."""


def post_all_gather_processing(model_params):
    """Rebuild FP8 transposes after the distributed optimizer's all-gather: unquantized parameters need none."""


# ---- contexts and recipes ------------------------------------------------------------------------------------------


def get_fp8_recipe(config: TransformerConfig):
    """The FP8 recipe for ``config`` (a :class:`Fp8ScalingRecipe`), or None while ``config.fp8`` is unset."""
    return Fp8ScalingRecipe.from_config(config)


def get_fp8_context(config: TransformerConfig, layer_no: int = -1, is_init: bool = False):
    """The context to run global layer ``layer_no`` in (``-1``: any layer): the FP8 region of ``config``'s recipe,
    or a no-op context without ``config.fp8`` or for a first / last BF16 layer. ``is_init`` (building FP8
    parameters) is a no-op context unless ``config.fp8_param`` asks for them, which is refused."""
    if is_init:
        if getattr(config, "fp8_param", False):
            raise _refuse("get_fp8_context(is_init=True) with fp8_param=True")
        return nullcontext()
    return fp8_layer_context(config, layer_no)


def prepare_model_for_fp8_inference(model):
    """Pad the inputs of Transformer Engine linears for FP8 inference; refused, as there is no FP8 inference."""
    raise _refuse("prepare_model_for_fp8_inference needs Transformer Engine FP8 layers")
