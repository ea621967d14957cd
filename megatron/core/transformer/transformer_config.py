"""TransformerConfig: the shape and behaviour of a transformer (Megatron-Core's field names and defaults)."""

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.utils import init_method_normal, scaled_init_method_normal, warn_once

_RECOMPUTE_GRANULARITIES = ("full", "selective")
_RECOMPUTE_METHODS = ("uniform", "block")
_SELECTIVE_MODULES = ("core_attn", "mlp", "layernorm")
_NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Everything a transformer block needs to build and run its layers."""

    # ---- model shape ----
    num_layers: int = 0
    """Number of transformer layers in the whole model (all pipeline stages)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on the first pipeline stage for an uneven split (the rest are divided evenly)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on the last pipeline stage for an uneven split."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as a layer when splitting layers over pipeline stages."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the loss as a layer when splitting layers over pipeline stages."""
    hidden_size: int = 0
    """Transformer hidden size."""
    num_attention_heads: int = 0
    """Number of attention heads."""
    attention_backend: AttnBackend = AttnBackend.auto
    """Attention implementation; every backend runs PyTorch's SDPA or the explicit softmax path here."""
    softmax_scale: Optional[float] = None
    """Attention score scale (None: 1/sqrt(kv_channels))."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention (None: num_attention_heads, i.e. multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (None: 4 * hidden_size)."""
    kv_channels: Optional[int] = None
    """Per-head projection size (None: hidden_size // num_attention_heads)."""
    hidden_dropout: float = 0.1
    """Dropout after attention and MLP outputs."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32."""
    apply_residual_connection_post_layernorm: bool = False
    """Take the residual from the layernorm output instead of its input."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    layernorm_zero_centered_gamma: bool = False
    """Store norm weights as (gamma - 1), initialised to zero."""
    add_bias_linear: bool = True
    """Biases in all linear layers (``--disable-bias-linear`` turns them off)."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection even when add_bias_linear is off."""
    gated_linear_unit: bool = False
    """Gated MLP (SwiGLU when activation_func is silu): fc1 produces two halves, act(a) * b."""
    activation_func: Callable = F.gelu
    """MLP activation."""
    num_moe_experts: Optional[int] = None
    """Number of MoE experts (None: dense MLP)."""
    rotary_interleaved: bool = False
    """Rotate interleaved pairs instead of the two halves of each head."""
    window_size: Optional[tuple] = None
    """Sliding-window attention (not supported yet: must be None)."""
    normalization: str = "LayerNorm"
    """'LayerNorm' or 'RMSNorm'."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head before attention."""
    test_mode: bool = False
    """Megatron's test switch, accepted."""
    calculate_per_token_loss: bool = False
    """Divide the loss by the global token count across micro-batches and DP ranks, not per micro-batch."""
    multi_latent_attention: bool = False
    """Multi-latent attention (not supported yet: must be False)."""

    # ---- initialisation ----
    init_method: Optional[Callable] = None
    """Init of most weights (None: N(0, init_method_std^2))."""
    output_layer_init_method: Optional[Callable] = None
    """Init of output projections (None: N(0, (init_method_std / sqrt(2 * num_layers))^2))."""
    init_method_std: float = 0.02
    """Standard deviation of the default init methods."""

    # ---- numerics ----
    apply_query_key_layer_scaling: bool = False
    """Scale attention scores by 1/layer_number and back inside softmax (fp16 stability)."""
    attention_softmax_in_fp32: bool = True
    """Compute the attention softmax in fp32."""

    # ---- fusions (accepted; pure-PyTorch twins are used where the kernel is absent) ----
    bias_activation_fusion: bool = False
    """Fuse bias add and activation."""
    masked_softmax_fusion: bool = False
    """Fuse scale, mask and softmax."""
    persist_layer_norm: bool = False
    """Persistent layer-norm kernel (apex)."""
    memory_efficient_layer_norm: bool = False
    """Memory-efficient layer-norm kernel (apex)."""
    bias_dropout_fusion: bool = False
    """Fuse bias add, dropout and residual add."""
    apply_rope_fusion: bool = False
    """Fused rotary-embedding kernel."""

    # ---- activation recomputation ----
    recompute_granularity: Optional[str] = None
    """'full' (whole layers) or 'selective' (parts named in recompute_modules); None: off."""
    recompute_method: Optional[str] = None
    """For full recomputation: 'uniform' (checkpoint groups of recompute_num_layers) or 'block' (the first
    recompute_num_layers layers of each stage)."""
    recompute_num_layers: Optional[int] = None
    """Layers per checkpointed group ('uniform') or layers to checkpoint ('block')."""
    distribute_saved_activations: Optional[bool] = None
    """Split checkpointed layer inputs across the TP group (saves memory; not with sequence parallelism)."""
    recompute_modules: Optional[List[str]] = None
    """Selective recomputation targets among 'core_attn', 'mlp', 'layernorm' (None: ['core_attn'])."""

    # ---- mixed precision training of the norm/embedding (Megatron fields used by later features) ----
    fp8: Optional[str] = None
    """FP8 training (needs Transformer Engine; not available here: must be None)."""

    def __post_init__(self):
        super().__post_init__()
        _validate_shape(self)
        _derive_defaults(self)
        _validate_tensor_parallel_split(self)
        _validate_recompute(self)
        _validate_unsupported(self)
        _warn_about_fusions(self)
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)


def _validate_shape(config: TransformerConfig) -> None:
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
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
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({config.hidden_size}) must be divisible by num_attention_heads "
                f"({config.num_attention_heads}) unless kv_channels is set"
            )
        config.kv_channels = config.hidden_size // config.num_attention_heads
    if config.num_query_groups is None:
        config.num_query_groups = config.num_attention_heads
    if config.num_attention_heads % config.num_query_groups != 0:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of num_query_groups "
            f"({config.num_query_groups})"
        )


def _validate_tensor_parallel_split(config: TransformerConfig) -> None:
    tp = config.tensor_model_parallel_size
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        value = getattr(config, name)
        if value % tp != 0:
            raise ValueError(
                f"{name} ({value}) must be divisible by tensor_model_parallel_size ({tp}); "
                f"change {name} or the tensor-parallel size"
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
                "recompute_granularity='full' needs recompute_num_layers >= 1, "
                f"got {config.recompute_num_layers!r}"
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


def _validate_unsupported(config: TransformerConfig) -> None:
    if config.window_size is not None:
        raise ValueError(f"window_size={config.window_size} (sliding-window attention) is not supported; use None")
    if config.multi_latent_attention:
        raise ValueError("multi_latent_attention is not supported; use standard or grouped-query attention")
    if config.fp8 is not None:
        raise ValueError(f"fp8={config.fp8!r} needs Transformer Engine FP8 support, which is not available; use None")


def _warn_about_fusions(config: TransformerConfig) -> None:
    for name in (
        "bias_activation_fusion",
        "masked_softmax_fusion",
        "persist_layer_norm",
        "memory_efficient_layer_norm",
        "bias_dropout_fusion",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "cross_entropy_loss_fusion",
    ):
        if getattr(config, name):
            warn_once(f"{name}=True: no fused kernel is available here; using the equivalent PyTorch operations")
