"""Megatron-Core's FP8 helpers (``megatron.core.fp8_utils``), as they behave where FP8 is off.

Megatron implements these on Transformer Engine's quantized tensor classes. This project has no FP8 training yet
(``TransformerConfig`` refuses ``fp8=...`` and the other FP8 fields), so no tensor here is ever quantized. The
functions keep Megatron's names and signatures and answer as Megatron does without Transformer Engine: the
predicates are False for every tensor, the contexts are no-ops, the per-step hooks do nothing for unquantized
parameters, and the pure helpers (alignment size, first/last BF16 layers, linear-layer kinds) compute their answer.
Whatever would need an FP8 tensor, or a config that actually asks for FP8, raises one ``ValueError`` saying so.
"""

from contextlib import nullcontext
from typing import List

import torch

from megatron.core.enums import Fp8Recipe
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

HAVE_TE = False
"""Whether Transformer Engine's FP8 classes are in use (never, here); Megatron's tests read this flag."""

_NO_FP8 = (
    "not supported yet: FP8 training ({what}); this project has no FP8 tensors. Leave fp8 / fp8_param unset "
    "(train in bf16 or fp32)"
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


def dequantize_fp8_tensor(fp8_tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision value of an FP8 tensor; refused, as no tensor here is FP8."""
    raise _refuse(f"dequantize_fp8_tensor got a {type(fp8_tensor).__name__}, not a Transformer Engine FP8 tensor")


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


def is_first_last_bf16_layer(config: TransformerConfig, layer_no: int) -> bool:
    """Whether global layer ``layer_no`` (0-based) stays in BF16 under ``first_last_layers_bf16``: one of the first
    ``num_layers_at_start_in_bf16`` or last ``num_layers_at_end_in_bf16`` layers. A negative ``layer_no`` (the
    whole model) never is."""
    if layer_no < 0 or not config.first_last_layers_bf16:
        return False
    return layer_no < config.num_layers_at_start_in_bf16 or layer_no >= (
        config.num_layers - config.num_layers_at_end_in_bf16
    )


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


# ---- contexts and recipes: no-ops while FP8 is off, one error when it is asked for --------------------------------


def get_fp8_recipe(config: TransformerConfig):
    """The FP8 recipe for ``config``: None while ``config.fp8`` is unset; FP8 itself is refused."""
    if getattr(config, "fp8", None):
        raise _refuse(f"get_fp8_recipe with fp8={config.fp8!r}")
    return None


def get_fp8_context(config: TransformerConfig, layer_no: int = -1, is_init: bool = False):
    """The context to run layer ``layer_no`` (or to build parameters, ``is_init``) in: a no-op context while
    ``config.fp8`` (``config.fp8_param`` for ``is_init``) is unset; FP8 itself is refused."""
    requested = getattr(config, "fp8_param", False) if is_init else getattr(config, "fp8", None)
    if requested:
        field = "fp8_param" if is_init else "fp8"
        raise _refuse(f"get_fp8_context with {field}={requested!r}")
    return nullcontext()


def prepare_model_for_fp8_inference(model):
    """Pad the inputs of Transformer Engine linears for FP8 inference; refused, as there is no FP8 inference."""
    raise _refuse("prepare_model_for_fp8_inference needs Transformer Engine FP8 layers")
