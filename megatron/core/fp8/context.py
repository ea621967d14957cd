"""Which layers run in FP8, and the region they run in: what Megatron's ``fp8_utils.get_fp8_context`` returns.

``TransformerBlock`` enters :func:`fp8_layer_context` around each layer, so the layer's linear layers quantise with
the config's recipe; embeddings, the output layer and the first / last ``num_layers_at_{start,end}_in_bf16`` layers
(with ``first_last_layers_bf16``) stay in the parameters' precision. Amaxes are reduced over Megatron's amax
reduction group (tensor x data (x context) parallel ranks, or tensor (x context) only with ``tp_only_amax_red``).
"""

from __future__ import annotations

from contextlib import nullcontext

from megatron.core import parallel_state
from megatron.core.fp8.recipe import Fp8ScalingRecipe, fp8_autocast
from megatron.core.public_api import public_api


@public_api("megatron.core.fp8_utils")
def is_first_last_bf16_layer(config, layer_no: int) -> bool:
    """Whether global layer ``layer_no`` (0-based) stays in BF16 under ``first_last_layers_bf16``: one of the first
    ``num_layers_at_start_in_bf16`` or last ``num_layers_at_end_in_bf16`` layers. A negative ``layer_no`` (the
    whole model) never is."""
    if layer_no < 0 or not config.first_last_layers_bf16:
        return False
    return layer_no < config.num_layers_at_start_in_bf16 or layer_no >= (
        config.num_layers - config.num_layers_at_end_in_bf16
    )


def fp8_layer_context(config, layer_no: int = -1):
    """The FP8 region for global layer ``layer_no`` (``-1``: every layer), or a no-op context when ``config.fp8``
    is unset or the layer stays in BF16."""
    recipe = Fp8ScalingRecipe.from_config(config)
    if recipe is None or is_first_last_bf16_layer(config, layer_no):
        return nullcontext()
    group = None
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_amax_reduction_group(
            with_context_parallel=True, tp_only_amax_red=getattr(config, "tp_only_amax_red", False)
        )
    return fp8_autocast(recipe, group)
