"""Validation of TransformerConfig's own fields, called from ``TransformerConfig.__post_init__`` (and
``MLATransformerConfig``'s), in the order it lists them; the mixture-of-experts fields are checked by
:mod:`megatron.core.transformer.moe.moe_config_validation`.

One small function per rule; each failure is one ValueError naming the field(s), the value(s) and the fix, raised
while the config is built, before any model or collective exists. The ``_derive_*`` functions fill in the defaults
Megatron derives (FFN size, kv_channels, query groups, init methods).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from megatron.core.fp8.recipe import RECIPE_BLOCK_SIZES, Fp8ScalingRecipe
from megatron.core.transformer.activation_offload import validate_offload_modules
from megatron.core.transformer.enums import CP_COMM_TYPES
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.utils import init_method_normal, scaled_init_method_normal, warn_once

if TYPE_CHECKING:  # type hints only: transformer_config imports this module
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

_RECOMPUTE_GRANULARITIES = ("full", "selective")
_RECOMPUTE_METHODS = ("uniform", "block")
_SELECTIVE_MODULES = ("core_attn", "mlp", "layernorm", "moe")
_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")
_ROPE_TYPES = ("rope", "yarn")

# Knobs that only select a fused GPU kernel or implementation: accepted at any value, with one warning when set,
# because the pure-PyTorch code computes the same result. (bias_activation_fusion, persist_layer_norm,
# apply_rope_fusion, cross_entropy_loss_fusion, masked_softmax_fusion, bias_dropout_fusion, moe_permute_fusion,
# moe_router_fusion and gradient_accumulation_fusion select megatron.core.fusions, which runs on every device.)
_KERNEL_KNOBS = (
    "memory_efficient_layer_norm",
    "use_fused_weighted_squared_relu",
    "fused_single_qkv_rope",
    "fused_residual_rmsnorm",
    "use_transformer_engine_op_fuser",
    "use_te_activation_func",
    "use_grouped_gemm_for_dense_mlp",
    "disable_parameter_transpose_cache",
    "symmetric_ar_type",
)


# Megatron 0.19 defaults these to 0, meaning "not set yet": a config made only to carry settings (e.g. for DDP or
# an optimizer) constructs without them. Building a model checks them (require_model_sizes).
_MODEL_SIZES = ("num_layers", "hidden_size", "num_attention_heads")


def _validate_shape(config: TransformerConfig) -> None:
    for name in _MODEL_SIZES:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a positive integer (or 0, not set yet), got {value!r}")
    if config.num_layers == 0 and config.output_layer_init_method is None:
        # As in Megatron, which scales the default output-layer init by 1 / sqrt(2 * num_layers).
        raise ValueError(
            "num_layers=0 leaves the default output_layer_init_method undefined (it is scaled by num_layers); "
            "set num_layers or pass output_layer_init_method"
        )
    if config.normalization not in _NORMALIZATIONS:
        raise ValueError(f"normalization={config.normalization!r} is not supported; use one of {_NORMALIZATIONS}")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(config, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")


def _derive_defaults(config: TransformerConfig) -> None:
    if config.ffn_hidden_size is None:
        config.ffn_hidden_size = 4 * config.hidden_size
    if config.kv_channels is None:
        if config.num_attention_heads == 0:
            raise ValueError(
                "num_attention_heads=0 (not set) leaves kv_channels undefined (it defaults to hidden_size // "
                "num_attention_heads); set num_attention_heads or kv_channels"
            )
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({config.hidden_size}) must be divisible by num_attention_heads "
                f"({config.num_attention_heads}) unless kv_channels is set"
            )
        config.kv_channels = config.hidden_size // config.num_attention_heads
    if config.num_query_groups is None:
        config.num_query_groups = config.num_attention_heads
    if config.num_query_groups and config.num_attention_heads % config.num_query_groups != 0:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of num_query_groups "
            f"({config.num_query_groups})"
        )
    # Scaling scores by 1/layer_number and back only keeps fp16 scores in range when the softmax runs in fp32;
    # with that, the result equals unscaled attention.
    if config.apply_query_key_layer_scaling:
        config.attention_softmax_in_fp32 = True


def require_model_sizes(config: TransformerConfig, module: str, attention: bool = False) -> None:
    """Refuse to build ``module`` from a config whose sizes are still Megatron's 0 ("not set") defaults.

    ``attention`` adds the attention sizes (heads, query groups, head size), which a Mamba-only stack does not use.
    """
    names = ("hidden_size", "num_attention_heads", "num_query_groups", "kv_channels") if attention else ("hidden_size",)
    unset = [f"{name}={getattr(config, name)!r}" for name in names if not getattr(config, name)]
    if unset:
        raise ValueError(
            f"{module} cannot be built with {', '.join(unset)}: TransformerConfig accepts 0 as 'not set', but a "
            "model needs positive sizes; set them in the config"
        )


def _validate_pipeline_layout(config: TransformerConfig) -> None:
    """``pipeline_model_parallel_layout`` (a string, a list of stages, or a PipelineParallelLayerLayout) becomes a
    checked PipelineParallelLayerLayout, and gives the virtual pipeline size (Megatron's rules)."""
    layout = config.pipeline_model_parallel_layout
    if layout is None:
        return
    others = {
        "num_layers_in_first_pipeline_stage": config.num_layers_in_first_pipeline_stage,
        "num_layers_in_last_pipeline_stage": config.num_layers_in_last_pipeline_stage,
        "account_for_embedding_in_pipeline_split": config.account_for_embedding_in_pipeline_split or None,
        "account_for_loss_in_pipeline_split": config.account_for_loss_in_pipeline_split or None,
    }
    conflicts = [f"{name}={value!r}" for name, value in others.items() if value is not None]
    if conflicts:
        raise ValueError(
            "pipeline_model_parallel_layout cannot be set with other pipeline layout arguments "
            f"({', '.join(conflicts)}); the layout places every layer itself, so unset them"
        )
    pp = config.pipeline_model_parallel_size
    if isinstance(layout, str):
        layout = PipelineParallelLayerLayout.from_str(layout, pp)
    elif isinstance(layout, list):
        layout = PipelineParallelLayerLayout(layout, pp)
    elif not isinstance(layout, PipelineParallelLayerLayout):
        raise ValueError(
            f"pipeline_model_parallel_layout must be a layout string, a list of stages or a "
            f"PipelineParallelLayerLayout, got {type(layout).__name__}"
        )
    if layout.pipeline_model_parallel_size != pp:
        raise ValueError(
            f"pipeline_model_parallel_layout {layout!r} was built for pipeline_model_parallel_size="
            f"{layout.pipeline_model_parallel_size}, but the config has {pp}; build it for {pp}"
        )
    detected_vpp = layout.virtual_pipeline_model_parallel_size
    configured_vpp = config.virtual_pipeline_model_parallel_size
    if configured_vpp is not None and configured_vpp != detected_vpp:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size conflicts with pipeline_model_parallel_layout "
            f"(virtual_pipeline_model_parallel_size={configured_vpp}, the layout gives {detected_vpp} stages per "
            f"pipeline rank); unset virtual_pipeline_model_parallel_size or change the layout"
        )
    if detected_vpp > 1 and pp == 1:
        raise ValueError(
            f"pipeline_model_parallel_layout {layout!r} has {detected_vpp} stages but pipeline_model_parallel_size "
            "is 1; virtual stages need pipeline_model_parallel_size > 1, so give one stage per pipeline rank"
        )
    layout.validate_layer_layout(num_layers=config.num_layers, mtp_num_layers=config.mtp_num_layers)
    config.pipeline_model_parallel_layout = layout
    if detected_vpp > 1:
        config.virtual_pipeline_model_parallel_size = detected_vpp


def _validate_tensor_parallel_split(config: TransformerConfig) -> None:
    tp = config.tensor_model_parallel_size
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        value = getattr(config, name)
        if value % tp != 0:
            raise ValueError(
                f"{name} ({value}) must be divisible by tensor_model_parallel_size ({tp}); "
                f"change {name} or the tensor-parallel size"
            )


_MAMBA_SSM_STATES_DTYPES = (None, torch.float32, torch.bfloat16)


def _validate_context_parallel(config: TransformerConfig) -> None:
    """cp_comm_type values (one, or one per layer), the head split a2a needs, and a2a+p2p's hierarchy."""
    cp = config.context_parallel_size
    sizes = config.hierarchical_context_parallel_sizes
    if sizes:
        if any(not isinstance(size, int) or size < 1 for size in sizes) or math.prod(sizes) != cp:
            raise ValueError(
                f"hierarchical_context_parallel_sizes={list(sizes)} must be positive integers whose product is "
                f"context_parallel_size={cp}"
            )
    if cp == 1:
        return
    comm_types = config.cp_comm_type if isinstance(config.cp_comm_type, list) else [config.cp_comm_type]
    if isinstance(config.cp_comm_type, list) and len(comm_types) != config.num_layers:
        raise ValueError(
            f"cp_comm_type is a list of {len(comm_types)} values but the model has num_layers={config.num_layers}; "
            "give one value for every layer, or a single string"
        )
    tp = config.tensor_model_parallel_size
    for comm_type in comm_types:
        if comm_type is not None and comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}")
        if comm_type == "a2a+p2p" and (not sizes or len(sizes) != 2):
            raise ValueError(
                f"cp_comm_type='a2a+p2p' needs hierarchical_context_parallel_sizes=[a2a size, p2p size] with product "
                f"context_parallel_size={cp}, got {sizes!r}"
            )
        a2a_size = {"a2a": cp, "a2a+p2p": sizes[0] if sizes else 1}.get(comm_type, 1)
        for name in ("num_attention_heads", "num_query_groups"):
            per_rank = getattr(config, name) // tp
            if per_rank % a2a_size != 0:
                raise ValueError(
                    f"cp_comm_type={comm_type!r} scatters heads over {a2a_size} context-parallel ranks, but {name}="
                    f"{getattr(config, name)} gives {per_rank} per tensor-parallel rank, not divisible by "
                    f"{a2a_size}; use cp_comm_type='p2p' or 'all_gather', or a divisible head count"
                )


def _validate_sliding_window(config: TransformerConfig) -> None:
    """window_size is (left, right) with each bound an int >= -1; context parallelism has no windowed attention."""
    window = config.window_size
    if window is None:
        return
    if len(window) != 2 or any(isinstance(bound, bool) or not isinstance(bound, int) or bound < -1 for bound in window):
        raise ValueError(
            f"window_size={window!r} (--window-size) must be two integers (left, right), each >= 0 or -1 for unbounded"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            f"window_size={tuple(window)} (--window-size): sliding-window attention is not supported with "
            f"context_parallel_size={config.context_parallel_size}; use context_parallel_size=1 or no window"
        )


def _validate_mamba(config: TransformerConfig) -> None:
    """The Mamba sizes on their own; the mixer checks the sizes it derives (d_inner, heads) when it is built."""
    for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    heads, groups, tp = config.mamba_num_heads, config.mamba_num_groups, config.tensor_model_parallel_size
    if heads is not None:
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise ValueError(f"mamba_num_heads must be a positive integer or None, got {heads!r}")
        if heads % groups != 0:
            raise ValueError(
                f"mamba_num_heads ({heads}) must be a multiple of mamba_num_groups ({groups}); change one of them"
            )
        if heads % tp != 0:
            raise ValueError(
                f"mamba_num_heads ({heads}) must be divisible by tensor_model_parallel_size ({tp}); "
                "change mamba_num_heads or the tensor-parallel size"
            )
    if config.is_hybrid_model and groups % tp != 0:
        raise ValueError(
            f"mamba_num_groups ({groups}) must be divisible by tensor_model_parallel_size ({tp}) (groups are split "
            "over tensor-parallel ranks); change mamba_num_groups or the tensor-parallel size"
        )
    if config.mamba_training_ssm_states_dtype not in _MAMBA_SSM_STATES_DTYPES:
        raise ValueError(
            f"mamba_training_ssm_states_dtype={config.mamba_training_ssm_states_dtype!r} is not supported; use "
            "torch.float32, torch.bfloat16 or None"
        )


def _validate_recompute(config: TransformerConfig) -> None:
    granularity = config.recompute_granularity
    if granularity is None:
        return
    if granularity not in _RECOMPUTE_GRANULARITIES:
        raise ValueError(
            f"recompute_granularity={granularity!r} is not valid; use one of {_RECOMPUTE_GRANULARITIES} or None"
        )
    if granularity == "full":
        if config.recompute_method not in _RECOMPUTE_METHODS:
            raise ValueError(
                f"recompute_granularity='full' needs recompute_method in {_RECOMPUTE_METHODS}, "
                f"got {config.recompute_method!r}"
            )
        if not isinstance(config.recompute_num_layers, int) or config.recompute_num_layers < 1:
            raise ValueError(
                f"recompute_granularity='full' needs recompute_num_layers >= 1, got {config.recompute_num_layers!r}"
            )
    else:
        if config.recompute_num_layers is not None:
            raise ValueError(
                "recompute_num_layers must be None with recompute_granularity='selective', "
                f"got {config.recompute_num_layers}"
            )
        if config.recompute_modules is None:
            config.recompute_modules = ["core_attn"]
        unknown = [m for m in config.recompute_modules if m not in _SELECTIVE_MODULES]
        if unknown:
            raise ValueError(f"recompute_modules {unknown} are not supported; choose from {_SELECTIVE_MODULES}")
    if config.distribute_saved_activations and config.sequence_parallel:
        raise ValueError(
            "distribute_saved_activations cannot be combined with sequence_parallel (the activations are already "
            "split along the sequence); turn one of them off"
        )


def _validate_activation_offloading(config: TransformerConfig) -> None:
    """Megatron's rules for cpu_offloading (layer-wise) and fine_grained_activation_offloading (per module)."""
    if config.cpu_offloading and config.fine_grained_activation_offloading:
        raise ValueError(
            "cpu_offloading and fine_grained_activation_offloading are both set; choose one (whole layers or "
            "selected modules)"
        )
    if config.cpu_offloading:
        if not 0 < config.cpu_offloading_num_layers < config.num_layers:
            raise ValueError(
                f"cpu_offloading_num_layers={config.cpu_offloading_num_layers} must be between 1 and num_layers - 1 "
                f"(num_layers={config.num_layers}): the last layer's activations are needed at once"
            )
        if config.pipeline_model_parallel_size > 1:
            raise ValueError(
                "cpu_offloading (layer-wise activation offloading) does not work with pipeline parallelism "
                f"(pipeline_model_parallel_size={config.pipeline_model_parallel_size}); use "
                "fine_grained_activation_offloading"
            )
        if config.recompute_granularity is not None:
            raise ValueError(
                f"cpu_offloading does not work with activation recomputation (recompute_granularity="
                f"{config.recompute_granularity!r}); use one of them"
            )
    if config.fine_grained_activation_offloading:
        if not config.offload_modules:
            raise ValueError(
                "fine_grained_activation_offloading=True needs offload_modules (e.g. ['core_attn', 'attn_proj'])"
            )
        validate_offload_modules(config.offload_modules)
    if config.min_offloaded_tensor_size < 0:
        raise ValueError(f"min_offloaded_tensor_size={config.min_offloaded_tensor_size} must be >= 0")


def _validate_transformer_impl(config: TransformerConfig) -> None:
    if config.transformer_impl not in _TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={config.transformer_impl!r} is not valid; use one of {_TRANSFORMER_IMPLS}")
    if config.transformer_impl == "inference_optimized":
        raise ValueError(
            "not supported yet: inference-optimised layers (transformer_impl='inference_optimized'); "
            "use 'local' or 'transformer_engine'"
        )


def _validate_fp8(config: TransformerConfig) -> None:
    """The FP8 fields make a valid recipe, and every linear layer's contraction dimension (per tensor-parallel
    rank) is a whole number of the recipe's scaling blocks."""
    recipe = Fp8ScalingRecipe.from_config(config)  # None without fp8; raises naming a bad field
    if recipe is not None and config.tp_comm_overlap:
        raise ValueError(
            f"fp8={config.fp8!r} with tp_comm_overlap=True: the overlapped GEMMs (tensor_parallel/comm_overlap.py) "
            "do not run in FP8 yet; set one of them off"
        )
    if recipe is not None and config.num_moe_experts and config.moe_grouped_gemm:
        warn_once(
            f"fp8={config.fp8!r} with moe_grouped_gemm=True: the grouped-GEMM experts are not quantised yet and run "
            "in the parameters' precision (the other linear layers run in FP8)"
        )
    block = RECIPE_BLOCK_SIZES.get(recipe.recipe) if recipe is not None else None
    if block is None:
        return
    tp = config.tensor_model_parallel_size
    sizes = {
        "hidden_size": config.hidden_size,
        "ffn_hidden_size / tensor_model_parallel_size": config.ffn_hidden_size // tp,
        "num_attention_heads * kv_channels / tensor_model_parallel_size": (
            config.num_attention_heads * config.kv_channels // tp
        ),
    }
    if config.num_moe_experts and config.moe_ffn_hidden_size:
        sizes["moe_ffn_hidden_size / expert_tensor_parallel_size"] = config.moe_ffn_hidden_size // (
            config.expert_tensor_parallel_size or tp
        )
    for name, size in sizes.items():
        if size % block:
            raise ValueError(
                f"fp8_recipe={recipe.recipe!r} scales blocks of {block} elements along each linear layer's input "
                f"dimension, but {name} = {size} is not a multiple of {block}; choose sizes divisible by {block} "
                "or another fp8_recipe (tensorwise, delayed)"
            )


def _warn_about_kernel_knobs(config: TransformerConfig) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(type(config))}
    for name in _KERNEL_KNOBS:
        value = getattr(config, name)
        if value != defaults[name]:
            warn_once(f"{name}={value!r}: no fused kernel is available here; using the equivalent PyTorch operations")


def _apply_matmul_precision(config: TransformerConfig) -> None:
    # Megatron applies this process-wide switch from the config; it only changes CUDA bf16 matmuls.
    if config.bf16 and config.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def _derive_init_methods(config: TransformerConfig) -> None:
    if config.embedding_init_method_std is None:
        config.embedding_init_method_std = config.init_method_std
    if config.embedding_init_method is None:
        # A caller's own init_method also initialises the embeddings, unless a separate embedding std is asked for.
        if config.init_method is not None and config.embedding_init_method_std == config.init_method_std:
            config.embedding_init_method = config.init_method
        else:
            config.embedding_init_method = init_method_normal(config.embedding_init_method_std)
    if config.init_method is None:
        config.init_method = init_method_normal(config.init_method_std)
    if config.output_layer_init_method is None:
        config.output_layer_init_method = scaled_init_method_normal(config.init_method_std, config.num_layers)


def _validate_mla(config: MLATransformerConfig) -> None:
    if not config.multi_latent_attention:
        raise ValueError("MLATransformerConfig needs multi_latent_attention=True; use TransformerConfig otherwise")
    if config.rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type={config.rope_type!r} is not valid; use one of {_ROPE_TYPES}")
    for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
