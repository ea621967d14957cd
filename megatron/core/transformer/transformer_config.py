"""TransformerConfig: the shape and behaviour of a transformer (Megatron-Core's field names and defaults).

Every field of Megatron-Core 0.19's TransformerConfig and MLATransformerConfig is accepted with Megatron's default.
Fields of features this project does not build yet are listed in ``megatron.core.not_supported_yet`` and refused
when set; GPU-kernel knobs are accepted and warn once that they have no effect here.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.config_validation import (
    _apply_matmul_precision,
    _derive_defaults,
    _validate_pipeline_layout,
    _derive_init_methods,
    _validate_context_parallel,
    _validate_sliding_window,
    _validate_mamba,
    _validate_mla,
    _validate_activation_offloading,
    _validate_recompute,
    _validate_shape,
    _validate_tensor_parallel_split,
    _validate_transformer_impl,
    _validate_fp8,
    _warn_about_kernel_knobs,
)
from megatron.core.transformer.moe.moe_config_validation import validate_moe_config


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Everything a transformer block needs to build and run its layers."""

    # ---- model shape ----
    num_layers: int = 0
    """Number of transformer layers in the whole model (all pipeline stages)."""
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction layers (not supported yet: must be None)."""
    mtp_loss_scaling_factor: Optional[float] = 0.1
    """Weight of the multi-token prediction loss (not supported yet: must stay 0.1)."""
    mtp_use_repeated_layer: bool = False
    """Multi-token prediction: reuse one layer for every depth (not supported yet)."""
    mtp_detach_heads: bool = False
    """Multi-token prediction: detach the heads' inputs from the main model (not supported yet)."""
    mtp_hybrid_override_pattern: Optional[str] = None
    """Multi-token prediction: hybrid layer pattern of the MTP layers (not supported yet)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on the first pipeline stage for an uneven split (the rest are divided evenly)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on the last pipeline stage for an uneven split."""
    pipeline_model_parallel_layout: Optional[Union[str, list]] = None
    """Explicit layer-to-stage layout such as 'Et|(tt|)*3L' (not supported yet: must be None)."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as a layer when splitting layers over pipeline stages."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the loss as a layer when splitting layers over pipeline stages."""
    hidden_size: int = 0
    """Transformer hidden size."""
    num_attention_heads: int = 0
    """Number of attention heads."""
    attention_backend: AttnBackend = AttnBackend.auto
    """Attention implementation: unfused/local the explicit reference, fused PyTorch SDPA, flash SDPA or the Triton
    flash kernel (sliding windows), auto the fastest that serves the config (docs/attention-backends.md)."""
    flash_attention_version: Optional[int] = None
    """Flash-attention major version for attention_backend=flash (no effect here)."""
    softmax_scale: Optional[float] = None
    """Attention score scale (None: 1/sqrt(kv_channels))."""
    softmax_type: str = "vanilla"
    """Attention softmax: 'vanilla'; 'off-by-one' and 'learnable' are not supported yet."""
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
    activation_func_fp8_input_store: bool = False
    """Keep the activation's input in FP8 for backward (not supported yet: FP8)."""
    glu_linear_offset: float = 0.0
    """Offset added to the linear half of a gated MLP, act(a) * (b + offset) (not supported yet: must be 0)."""
    activation_func_clamp_value: Optional[float] = None
    """Clamp fc1's output inside the activation (not supported yet: must be None)."""
    num_moe_experts: Optional[int] = None
    """Number of MoE experts (None: dense MLP)."""
    rotary_interleaved: bool = False
    """Rotate interleaved pairs instead of the two halves of each head."""
    window_size: Optional[Tuple[int, int]] = None
    """Sliding-window attention (left, right): a query sees keys at most ``left`` before and ``right`` after its
    position; -1 is unbounded. None: full attention."""
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    """Which layers use full attention among sliding-window layers: every N-th layer for an int N, or a list of
    1 (window) / 0 (full) per layer."""
    normalization: str = "LayerNorm"
    """'LayerNorm' or 'RMSNorm'."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head before attention."""
    qk_l2_norm: bool = False
    """L2-normalise queries and keys, Llama-4 style (not supported yet: must be False)."""
    qk_clip: bool = False
    """Clip query/key weights by the largest attention logit (not supported yet: must be False)."""
    qk_clip_alpha: float = 0.5
    """QK-clip balancing exponent (not supported yet)."""
    qk_clip_threshold: float = 100
    """QK-clip logit threshold (not supported yet)."""
    log_max_attention_logit: bool = False
    """Track the largest attention logit of the model (not supported yet: must be False)."""
    attention_output_gate: bool = False
    """Gate the attention output per head dimension (not supported yet: must be False)."""
    test_mode: bool = False
    """Megatron's test switch, accepted."""
    calculate_per_token_loss: bool = False
    """Divide the loss by the global token count across micro-batches and DP ranks, not per micro-batch."""
    multi_latent_attention: bool = False
    """Multi-latent attention (not supported yet: must be False; Megatron's MLATransformerConfig turns it on)."""
    no_rope_freq: Optional[Union[int, List[int]]] = None
    """Layers that skip rotary embeddings (not supported yet: must be None)."""
    experimental_attention_variant: Optional[str] = None
    """Experimental attention variant such as 'gated_delta_net' or 'dsa' (not supported yet: must be None)."""
    experimental_attention_variant_loss_scale_func: Optional[Callable] = None
    """Loss-scale hook of an experimental attention variant (not supported yet: must be None)."""
    dsa_indexer_n_heads: Optional[int] = None
    """DeepSeek sparse attention: indexer heads (not supported yet)."""
    dsa_indexer_head_dim: Optional[int] = None
    """DeepSeek sparse attention: indexer head size (not supported yet)."""
    dsa_indexer_topk: Optional[int] = None
    """DeepSeek sparse attention: tokens the indexer selects (not supported yet)."""
    dsa_indexer_topk_freq: int = 1
    """DeepSeek sparse attention: layers sharing one top-k selection (not supported yet)."""
    dsa_indexer_skip_topk_offset: int = 0
    """DeepSeek sparse attention: layer offset of top-k sharing (not supported yet)."""
    dsa_indexer_loss_coeff: Optional[float] = None
    """DeepSeek sparse attention: indexer loss weight (not supported yet)."""
    dsa_indexer_use_sparse_loss: bool = False
    """DeepSeek sparse attention: sparse indexer loss (not supported yet)."""
    dsa_kernel_backend: str = "none"
    """DeepSeek sparse attention: fused kernel backend (not supported yet)."""
    dsa_indexer_rope_interleaved: bool = False
    """DeepSeek sparse attention: interleaved RoPE in the indexer (not supported yet)."""
    dsa_indexer_rotate_activation: bool = True
    """DeepSeek sparse attention: Hadamard rotation before scoring (not supported yet)."""
    dsa_indexer_scoring_relu: bool = True
    """DeepSeek sparse attention: ReLU on indexer scores (not supported yet)."""
    dsa_indexer_k_norm_epsilon: Optional[float] = None
    """DeepSeek sparse attention: epsilon of the indexer key norm (not supported yet)."""
    dsa_indexer_k_norm_fp32: bool = False
    """DeepSeek sparse attention: indexer key norm in fp32 (not supported yet)."""
    linear_attention_freq: Optional[Union[int, List[int]]] = None
    """Linear-attention (gated delta net) layer pattern (not supported yet: must be None)."""
    linear_conv_kernel_dim: Optional[int] = 4
    """Gated delta net: convolution kernel size (not supported yet)."""
    linear_key_head_dim: Optional[int] = 128
    """Gated delta net: query/key head size (not supported yet)."""
    linear_value_head_dim: Optional[int] = 128
    """Gated delta net: value head size (not supported yet)."""
    linear_num_key_heads: Optional[int] = 16
    """Gated delta net: query/key heads (not supported yet)."""
    linear_num_value_heads: Optional[int] = 32
    """Gated delta net: value heads (not supported yet)."""

    # ---- initialisation ----
    init_method: Optional[Callable] = None
    """Init of most weights (None: N(0, init_method_std^2))."""
    output_layer_init_method: Optional[Callable] = None
    """Init of output projections (None: N(0, (init_method_std / sqrt(2 * num_layers))^2))."""
    init_method_std: float = 0.02
    """Standard deviation of the default init methods."""
    embedding_init_method: Optional[Callable] = None
    """Init of the embeddings (None: init_method, or N(0, embedding_init_method_std^2) when that std is set)."""
    embedding_init_method_std: Optional[float] = None
    """Standard deviation of the embedding init (None: init_method_std)."""
    init_model_with_meta_device: bool = False
    """Create parameters on the meta device (not supported yet: must be False)."""
    use_mup: bool = False
    """Maximal update parametrisation (not supported yet: must be False)."""
    mup_width_mult: float = 1.0
    """muP width multiplier (not supported yet)."""
    mup_base_hidden_size: Optional[int] = None
    """muP base model hidden size (not supported yet)."""
    mup_embedding_mult: float = 1.0
    """muP embedding output multiplier (not supported yet)."""
    mup_output_mult: float = 1.0
    """muP logit multiplier (not supported yet)."""
    mup_base_head_dim: Optional[float] = None
    """muP base head size (not supported yet)."""
    mup_attn_scale_power: float = 1.0
    """muP attention scale exponent (not supported yet)."""

    # ---- numerics ----
    apply_query_key_layer_scaling: bool = False
    """Scale attention scores by 1/layer_number and back inside softmax (fp16 stability); turns on
    attention_softmax_in_fp32, with which the result equals unscaled attention."""
    attention_softmax_in_fp32: bool = True
    """Compute the attention softmax in fp32."""
    disable_bf16_reduced_precision_matmul: bool = False
    """With bf16, forbid reduced-precision accumulation in CUDA bf16 matmuls (sets PyTorch's global switch)."""

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
    use_fused_weighted_squared_relu: bool = False
    """Fused weighted squared-ReLU kernel (MoE)."""
    fused_single_qkv_rope: bool = False
    """Apply RoPE to the fused QKV tensor without splitting it."""
    fused_residual_rmsnorm: bool = False
    """Fuse the residual add into the RMSNorm backward (Transformer Engine)."""
    use_transformer_engine_op_fuser: bool = False
    """Transformer Engine's operation fuser."""

    # ---- activation recomputation ----
    recompute_granularity: Optional[str] = None
    """'full' (whole layers) or 'selective' (parts named in recompute_modules); None: off."""
    recompute_method: Optional[str] = None
    """For full recomputation: 'uniform' (checkpoint groups of recompute_num_layers) or 'block' (the first
    recompute_num_layers layers of each stage)."""
    recompute_num_layers: Optional[int] = None
    """Layers per checkpointed group ('uniform') or layers to checkpoint ('block')."""
    distribute_saved_activations: Optional[bool] = False
    """Split checkpointed layer inputs across the TP group (saves memory; not with sequence parallelism)."""
    recompute_modules: Optional[List[str]] = None
    """Selective recomputation targets among 'core_attn', 'mlp', 'layernorm' (None: ['core_attn'])."""

    # ---- low precision (FP8 linear layers in pure PyTorch: docs/fp8.md; FP4 is not supported yet) ----
    fp8: Optional[str] = None
    """FP8 format of the transformer layers' linear GEMMs: 'e4m3', or 'hybrid' (E5M2 gradients); None: off."""
    fp8_recipe: Optional[str] = "delayed"
    """FP8 scaling recipe: 'tensorwise', 'delayed', 'mxfp8' or 'blockwise' ('custom' is not supported yet)."""
    fp8_param: bool = False
    """Keep parameters in FP8 (not supported yet)."""
    fp8_quantizer_factory: Optional[str] = None
    """Import path of a custom FP8 quantizer factory (not supported yet)."""
    fp8_margin: int = 0
    """Delayed scaling: scales are divided by 2**fp8_margin."""
    fp8_interval: int = 1
    """FP8 scaling-factor update interval (deprecated in Transformer Engine, which ignores it; so is it here)."""
    fp8_amax_history_len: int = 1
    """Delayed scaling: amax values remembered per tensor."""
    fp8_amax_compute_algo: str = "most_recent"
    """Delayed scaling: the scale's amax is the history's 'max' or its 'most_recent' entry."""
    fp8_wgrad: bool = True
    """Compute weight gradients in FP8 (False: in the parameters' precision)."""
    fp8_output_proj: bool = False
    """Run the output layer in FP8 (not supported yet)."""
    fp8_dot_product_attention: bool = False
    """FP8 core attention (not supported yet)."""
    fp8_multi_head_attention: bool = False
    """FP8 multi-head attention (not supported yet)."""
    tp_only_amax_red: bool = False
    """Reduce FP8 amaxes over the tensor (x context) parallel group only, not also over data-parallel ranks."""
    first_last_layers_bf16: bool = False
    """Keep the first and last layers out of FP8 (in the parameters' precision)."""
    num_layers_at_start_in_bf16: int = 1
    """Leading layers kept out of FP8 with first_last_layers_bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Trailing layers kept out of FP8 with first_last_layers_bf16."""
    use_kitchen: bool = False
    """Kitchen quantization extension (not supported yet)."""
    use_kitchen_attention: bool = False
    """Kitchen attention (not supported yet)."""
    kitchen_attention_backend: str = "sdpa"
    """Kitchen attention backend, 'sdpa' or 'fa' (not supported yet)."""
    fp4: Optional[str] = None
    """FP4 format (not supported yet: must be None)."""
    fp4_recipe: Optional[str] = "nvfp4"
    """FP4 scaling recipe, a megatron.core.enums.Fp4Recipe name (not supported yet)."""
    fp4_param: bool = False
    """Keep parameters in FP4 (not supported yet)."""
    fp4_quantizer_factory: Optional[str] = None
    """Import path of a custom FP4 quantizer factory (not supported yet)."""

    # ---- mixture of experts (validated in megatron/core/transformer/moe/moe_config_validation.py) ----
    high_priority_a2a_comm_stream: bool = False
    """Expert-parallel overlap: high-priority stream for the all-to-alls."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Total hidden size of the shared experts (None: no shared expert)."""
    moe_shared_expert_gate: bool = False
    """Gate the shared expert's output."""
    moe_shared_expert_overlap: bool = False
    """Overlap the shared expert with token dispatch."""
    use_grouped_gemm_for_shared_expert: bool = False
    """Grouped GEMM for the shared expert."""
    moe_shared_expert_glu_interleave_size: Optional[int] = None
    """Block-interleaved GLU layout in the shared expert."""
    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE layers: every N-th, or a 0/1 pattern."""
    moe_ffn_hidden_size: Optional[int] = None
    """Hidden size of each expert (None: ffn_hidden_size)."""
    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    """Router load balancing: 'aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn' or 'none'."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_enable_routing_replay: bool = False
    """Record and replay routing decisions."""
    moe_router_topk_limited_devices: Optional[int] = None
    """Deprecated device-limited routing (use moe_router_num_groups / moe_router_group_topk)."""
    moe_router_padding_for_quantization: Optional[bool] = False
    """Pad each expert's token count for quantized GEMMs."""
    moe_router_padding_for_fp8: Optional[bool] = False
    """Alias of moe_router_padding_for_quantization."""
    moe_router_num_groups: Optional[int] = None
    """Expert groups for group-limited routing."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token may use in group-limited routing."""
    moe_router_pre_softmax: bool = False
    """Apply the score function before the top-k selection."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Scale of the routing scores of the selected experts."""
    moe_router_score_function: str = "softmax"
    """Routing score function: 'softmax', 'sigmoid' or 'sqrtsoftplus'."""
    moe_router_dtype: Optional[str] = None
    """Routing dtype, 'fp32' or 'fp64' (None: the activation dtype)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing with a per-expert routing bias."""
    moe_router_bias_update_rate: float = 1e-3
    """Update rate of the per-expert routing bias."""
    moe_router_quantile_balancing_ema: float = 0.0
    """EMA factor of quantile-based router balancing."""
    moe_router_force_load_balancing: bool = False
    """Benchmarking: route with random logits."""
    moe_router_force_biased: Optional[float] = None
    """Benchmarking: random bias of this std added to the router logits."""
    use_grouped_gemm_for_dense_mlp: bool = False
    """Grouped GEMM kernel for the dense MLP (no effect here)."""
    moe_grouped_gemm: bool = False
    """Run the local experts' GEMMs as one grouped GEMM."""
    moe_single_grouped_weight: bool = False
    """Store the experts' weights as one grouped parameter."""
    moe_single_grouped_bias: bool = False
    """Store the experts' biases as one grouped parameter."""
    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    """Weight of the load-balancing loss."""
    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss."""
    moe_input_jitter_eps: Optional[float] = None
    """Multiplicative jitter on the router input."""
    moe_token_dropping: bool = False
    """Drop and pad tokens to the expert capacity."""
    moe_token_dispatcher_type: str = "allgather"
    """Token dispatcher: 'allgather', 'alltoall' or 'flex'."""
    moe_enable_deepep: bool = False
    """DeepEP token dispatch."""
    moe_flex_dispatcher_backend: str = "deepep"
    """Backend of the flex dispatcher."""
    moe_permute_fusion_into_hybridep: bool = False
    """Fuse the token permutation into HybridEP."""
    moe_hybridep_pad_uneven_dispatch_inputs: bool = False
    """HybridEP: pad uneven per-rank token counts."""
    moe_per_layer_logging: bool = False
    """Log MoE losses per layer."""
    moe_expert_capacity_factor: Optional[float] = None
    """Expert capacity factor (None: no token dropping)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad each expert's input to its capacity."""
    moe_pad_experts_for_cuda_graph_inference: bool = False
    """Inference: drop-and-pad routing for CUDA graphs."""
    moe_token_drop_policy: str = "probs"
    """Which tokens to drop over capacity: 'probs' or 'position'."""
    moe_layer_recompute: bool = False
    """Recompute MoE layers in backward."""
    moe_permute_fusion: bool = False
    """Fused token permutation kernels."""
    moe_router_fusion: bool = False
    """Fused routing and aux-loss kernels."""
    moe_apply_probs_on_input: bool = False
    """Apply the routing probabilities to the experts' input."""
    moe_latent_size: Optional[int] = None
    """Latent projection size of MoE layers."""
    moe_flex_dispatcher_num_sms: Optional[int] = None
    """SMs used by the flex dispatcher."""
    moe_deepep_num_sms: Optional[int] = None
    """Deprecated: SMs used by DeepEP."""
    moe_hybridep_num_sms: Optional[int] = None
    """Deprecated: SMs used by HybridEP."""
    moe_hybridep_num_blocks_permute: Optional[int] = None
    """HybridEP: thread blocks of the permute kernel."""
    moe_hybridep_num_blocks_unpermute: Optional[int] = None
    """HybridEP: thread blocks of the unpermute kernel."""
    moe_hybridep_num_sms_preprocessing: int = 108
    """HybridEP: SMs of the preprocessing kernel."""
    moe_ncclep_static_shape: bool = False
    """NCCL EP: fixed-size receive buffers."""
    moe_ncclep_zero_copy: bool = False
    """NCCL EP: zero-copy symmetric-memory buffers."""
    moe_mlp_glu_interleave_size: Optional[int] = None
    """Block-interleaved GLU layout in the expert MLPs."""
    moe_expert_rank_capacity_factor: Optional[float] = None
    """Capacity factor per expert rank."""

    # ---- context parallelism ----
    cp_comm_type: Optional[Union[str, List[str]]] = None
    """Context-parallel attention communication (one value, or a list with one per layer; None = 'p2p'): 'p2p'
    (ring attention), 'all_gather' (gather keys/values), 'a2a' (Ulysses head scatter) or 'a2a+p2p' (all-to-all
    inside groups of hierarchical_context_parallel_sizes[0] ranks, ring across them). Read only when
    context_parallel_size > 1."""

    # ---- CUDA graphs (not supported yet) ----
    enable_cuda_graph: bool = False
    """Deprecated switch for local CUDA graphs (not supported yet)."""
    cuda_graph_use_single_mempool: bool = True
    """CUDA graphs: one memory pool for every graph (not supported yet)."""
    cuda_graph_retain_backward_graph: bool = False
    """CUDA graphs: capture backward with retain_graph (not supported yet)."""
    cuda_graph_warmup_steps: int = 3
    """CUDA graphs: warm-up steps before capture (not supported yet)."""
    external_cuda_graph: bool = False
    """Deprecated switch for Transformer Engine CUDA graphs (not supported yet)."""
    cuda_graph_impl: str = "none"
    """CUDA graph implementation: 'none' here ('local' and 'transformer_engine' are not supported yet)."""
    cuda_graph_modules: Union[str, List[str]] = "full"
    """Parts of a layer each CUDA graph captures ('full' or [] for the whole layer); read only with graphs on."""
    inference_cuda_graph_scope: Optional[str] = None
    """Inference CUDA graph scope (not supported yet)."""
    cuda_graph_scope: Optional[Union[str, List[str]]] = None
    """Deprecated name of cuda_graph_modules (not supported yet)."""

    # ---- miscellaneous ----
    clone_scatter_output_in_embedding: bool = True
    """Clone the sequence-parallel scatter output of the embedding so its input can be freed (memory only)."""
    disable_parameter_transpose_cache: bool = False
    """Do not cache transposed weights between iterations (Transformer Engine; no effect here)."""
    config_logger_dir: str = ""
    """Directory the config logger writes to (not supported yet: must be empty)."""
    flash_decode: bool = False
    """Inference: flash-decoding kernel (not supported yet)."""
    batch_invariant_mode: bool = False
    """Batch-invariant kernels for bitwise-reproducible forward passes (not supported yet)."""
    use_te_activation_func: bool = False
    """Transformer Engine's activation functions (no effect here)."""
    inference_rng_tracker: bool = False
    """Inference: a separate RNG tracker (not supported yet)."""
    inference_sampling_seed: int = 42
    """Inference: sampling seed (not supported yet)."""
    symmetric_ar_type: Optional[str] = None
    """Symmetric-memory all-reduce kernel: 'two_shot', 'one_shot' or 'multimem_all_reduce' (no effect here)."""
    nccl_all_reduce_for_prefill: bool = False
    """Inference: NCCL all-reduce during prefill (not supported yet)."""
    use_inference_optimized_layers: bool = False
    """Inference-optimised layers (not supported yet)."""
    inference_fuse_tp_communication: bool = False
    """Inference: fused reduce-scatter/norm/all-gather kernel (not supported yet)."""
    inference_disable_triton_nvls_kernels: bool = False
    """Inference: disable Triton NVLS kernels (not supported yet)."""
    inference_grouped_gemm_backend: str = "vllm"
    """Inference: grouped GEMM backend of MoE layers (not supported yet)."""
    inference_moe_disable_fused_quant_kernels: bool = False
    """Inference: disable fused MoE quantisation kernels (not supported yet)."""
    inference_moe_token_dispatcher_type: str = "nvls"
    """Inference: MoE token dispatcher (not supported yet)."""
    mrope_section: Optional[List[int]] = None
    """Multimodal RoPE sections (not supported yet: must be None)."""

    # ---- Mamba / hybrid models ----
    is_hybrid_model: bool = False
    """The model mixes Mamba and attention layers (the Mamba sizes are then checked against the TP size here)."""
    mamba_state_dim: int = 128
    """Mamba-2 state size per head (``d_state``, the length of B and C per group)."""
    mamba_head_dim: int = 64
    """Mamba-2 head size (``headdim``): channels of x per head."""
    mamba_num_groups: int = 8
    """Mamba-2 groups of heads that share B and C; split over tensor-parallel ranks, so divisible by TP."""
    mamba_num_heads: Optional[int] = None
    """Mamba-2 heads; None: ``expand * hidden_size / mamba_head_dim``. Divisible by TP and by mamba_num_groups."""
    mamba_training_ssm_states_dtype: Optional[torch.dtype] = None
    """Dtype the SSM states passed between chunks are rounded to in training (torch.float32 or torch.bfloat16);
    None keeps them in fp32 in the PyTorch scan (mamba-ssm's kernels use their own default)."""
    use_mamba_mem_eff_path: bool = True
    """Use mamba-ssm's fused conv1d + scan + norm function for CUDA inputs when mamba-ssm is installed (it
    recomputes the conv in backward); otherwise the mixer runs the separate conv and scan."""
    mlp_chunks_for_prefill: int = 1
    """Inference: sequence chunks of the MLP during prefill (not supported yet: must be 1)."""
    mlp_chunks_for_training: int = 1
    """Sequence chunks of the MLP in training (not supported yet: must be 1)."""
    heterogeneous_block_specs: bool = False
    """Layers with different shapes (not supported yet: must be False)."""
    hetereogenous_dist_checkpoint: bool = False
    """Checkpoint layout of heterogeneous layers (Megatron's spelling; not supported yet: must be False)."""
    quant_recipe: Optional[Any] = None
    """Per-module quantization recipe (not supported yet: must be None)."""
    transformer_impl: str = "transformer_engine"
    """'transformer_engine' or 'local': the layer spec picks the modules, and without Transformer Engine the
    local modules run either way; 'inference_optimized' is not supported yet."""

    # ---- fine-grained activation offloading (not supported yet) ----
    fine_grained_activation_offloading: bool = False
    """Offload the inputs of selected modules to host memory."""
    offload_modules: Optional[List[str]] = field(default_factory=list)
    """Modules whose saved activations are offloaded: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm,
    expert_fc1 (Megatron's moe_act is not a module here)."""
    min_offloaded_tensor_size: int = 1024 * 1024
    """Smallest saved tensor (in elements) that fine-grained offloading moves to the host."""
    delay_offload_until_cuda_graph: bool = False
    """Delay offloading until the CUDA graph runs."""
    delta_offload_bytes_across_pp_ranks: int = 0
    """Offload-volume difference between pipeline ranks."""
    activation_offload_fraction: float = 1.0
    """Fraction of eligible activations to offload."""
    moe_paged_stash: bool = False
    """MoE paged stash of expert activations (not supported yet)."""
    moe_paged_stash_page_size: int = 64
    """MoE paged stash: tokens per page (not supported yet)."""
    moe_paged_stash_buffer_size_factor_cuda: float = 1.1
    """MoE paged stash: device buffer size factor (not supported yet)."""
    moe_paged_stash_buffer_size_factor_cpu: float = 0.0
    """MoE paged stash: host buffer size factor (not supported yet)."""
    fine_grained_offloading_max_inflight_offloads: Optional[int] = None
    """Offloads per module name that may be in flight at once."""

    def __post_init__(self):
        super().__post_init__()
        _validate_shape(self)
        _derive_defaults(self)
        _validate_pipeline_layout(self)
        _validate_tensor_parallel_split(self)
        _validate_context_parallel(self)
        _validate_sliding_window(self)
        _validate_mamba(self)
        validate_moe_config(self)
        _validate_recompute(self)
        _validate_activation_offloading(self)
        _validate_transformer_impl(self)
        _validate_fp8(self)
        _warn_about_kernel_knobs(self)
        _apply_matmul_precision(self)
        _derive_init_methods(self)


@dataclass
class MLATransformerConfig(TransformerConfig):
    """Megatron's config for multi-latent attention (DeepSeek-V2/V3) models, with its MLA and YaRN fields.

    It constructs and validates like Megatron's, but multi-latent attention itself is not built yet: attention
    modules refuse a config with ``multi_latent_attention=True``.
    """

    multi_latent_attention: bool = True
    """Multi-latent attention (always on for this config)."""
    normalization: str = "RMSNorm"
    """'LayerNorm' or 'RMSNorm' (MLA models use RMSNorm)."""
    q_lora_rank: int = 512
    """Rank of the low-rank query projection."""
    kv_lora_rank: int = 512
    """Rank of the low-rank key/value projection."""
    qk_head_dim: int = 128
    """Query/key head size without the rotary part."""
    qk_pos_emb_head_dim: int = 64
    """Rotary part of the query/key head size."""
    v_head_dim: int = 128
    """Value head size."""
    rope_type: str = "yarn"
    """Rotary embedding flavour: 'rope' or 'yarn'."""
    rotary_base: float = 10000
    """Rotary base."""
    rotary_percent: float = 1.0
    """Fraction of the rotary dimensions that rotate ('rope')."""
    rotary_scaling_factor: float = 40
    """YaRN context scaling factor."""
    original_max_position_embeddings: int = 4096
    """YaRN: context length of the original model."""
    beta_fast: float = 32
    """YaRN: fast-rotation boundary."""
    beta_slow: float = 1
    """YaRN: slow-rotation boundary."""
    mscale: float = 1.0
    """YaRN attention-scale factor."""
    mscale_all_dim: float = 0.0
    """YaRN attention-scale factor over all dimensions."""
    cache_mla_latents: bool = False
    """Inference: cache the compressed latents instead of full keys and values (not supported yet)."""
    mla_down_proj_fusion: bool = False
    """Fuse the query and key/value down-projections (kernel knob; no effect here)."""

    def __post_init__(self):
        super().__post_init__()
        _validate_mla(self)
