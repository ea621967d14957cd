"""Config fields of Megatron-Core features this project does not build yet, and the check that refuses them.

``ModelParallelConfig``, ``TransformerConfig`` and ``MLATransformerConfig`` accept every field Megatron-Core 0.19
has, with Megatron's defaults, so code written against Megatron constructs them unchanged. A field that belongs to
a feature listed here must stay at its default: set to anything else it is refused with one ``ValueError`` naming
the feature, the field and the value, before any model is built or any collective is issued. A feature's row is the
one place that refuses it; whoever builds the feature removes the row and validates the fields properly instead.

Not listed, and accepted at any value: knobs that only select or tune GPU kernels and communication overlap
(``*_fusion``, the userbuffers ``tp_comm_*`` knobs, ``flash_attention_version``, ...), which have no effect here
(the config warns where they would be expected to change something), and sub-options that Megatron itself ignores
until their feature is switched on (``cuda_graph_modules`` with ``cuda_graph_impl='none'``; Megatron-LM's command
line passes a non-default value by default).
"""

import dataclasses
from typing import Dict, Tuple

NOT_SUPPORTED_YET: Dict[str, Tuple[str, ...]] = {
    "hybrid context parallelism": ("hybrid_context_parallel", "max_seqlen_per_dp_cp_rank"),
    "GTP weight rematerialisation": (
        "tensor_parallel_num_weight_shards",
        "gtp_weight_remat_size",
        "expert_tensor_parallel_num_weight_shards",
        "expert_gtp_weight_remat_size",
    ),
    "MoE routing replay": ("moe_enable_routing_replay",),
    "MoE quantile balancing": ("moe_router_quantile_balancing_ema",),
    "MoE shared random router bias (benchmarking)": ("moe_router_force_biased",),
    "MoE padding for quantised grouped GEMMs": ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8"),
    "MoE single grouped weight / grouped-GEMM shared experts": (
        "moe_single_grouped_weight",
        "moe_single_grouped_bias",
        "use_grouped_gemm_for_shared_expert",
    ),
    "MoE block-interleaved GLU layout": ("moe_shared_expert_glu_interleave_size", "moe_mlp_glu_interleave_size"),
    "MoE legacy token dropping": ("moe_token_dropping",),
    "MoE latent projections": ("moe_latent_size",),
    "a caller-supplied MoE aux-loss scale (RL trainers)": ("moe_grad_scale_func",),
    "MoE per-rank capacity": ("moe_expert_rank_capacity_factor",),
    "MoE CUDA-graph inference padding": ("moe_pad_experts_for_cuda_graph_inference",),
    "MoE flex dispatcher (DeepEP / HybridEP / NCCL-EP kernels)": (
        "moe_enable_deepep",
        "moe_flex_dispatcher_backend",
        "moe_permute_fusion_into_hybridep",
        "moe_hybridep_pad_uneven_dispatch_inputs",
        "moe_flex_dispatcher_num_sms",
        "moe_deepep_num_sms",
        "moe_hybridep_num_sms",
        "moe_hybridep_num_blocks_permute",
        "moe_hybridep_num_blocks_unpermute",
        "moe_hybridep_num_sms_preprocessing",
        "moe_ncclep_static_shape",
        "moe_ncclep_zero_copy",
    ),
    "expert-parallel communication overlap": (
        "overlap_moe_expert_parallel_comm",
        "delay_wgrad_compute",
        "overlap_dispatch_backward_with_experts_wgrad",
        "ep_overlap_early_attn_memory_release",
        "high_priority_a2a_comm_stream",
    ),
    "MoE paged stash": (
        "moe_paged_stash",
        "moe_paged_stash_page_size",
        "moe_paged_stash_buffer_size_factor_cuda",
        "moe_paged_stash_buffer_size_factor_cpu",
    ),
    "multi-token prediction": (
        "mtp_grad_scale_func",
        "mtp_standalone",
        "mtp_num_layers",
        "mtp_loss_scaling_factor",
        "mtp_use_repeated_layer",
        "mtp_detach_heads",
        "mtp_hybrid_override_pattern",
    ),
    "CPU offloading of weights and its buffering options": (
        "_cpu_offloading_context",
        "cpu_offloading_weights",
        "cpu_offloading_double_buffering",
        "cpu_offloading_retain_pinned_cpu_buffers",
    ),
    "fine-grained activation offloading tuning": (
        "delay_offload_until_cuda_graph",
        "delta_offload_bytes_across_pp_ranks",
        "activation_offload_fraction",
        "fine_grained_offloading_max_inflight_offloads",
    ),
    "multi-latent attention": ("multi_latent_attention",),
    "softmax variants (off-by-one, learnable)": ("softmax_type",),
    "clamped / offset GLU activations": ("glu_linear_offset", "activation_func_clamp_value"),
    "L2 query/key normalisation": ("qk_l2_norm",),
    "QK-clip": ("qk_clip", "qk_clip_alpha", "qk_clip_threshold", "log_max_attention_logit"),
    "attention output gate": ("attention_output_gate",),
    "layers without RoPE": ("no_rope_freq",),
    "multimodal RoPE": ("mrope_section",),
    "experimental attention variants (DeepSeek sparse attention)": (
        "experimental_attention_variant",
        "experimental_attention_variant_loss_scale_func",
        "dsa_indexer_n_heads",
        "dsa_indexer_head_dim",
        "dsa_indexer_topk",
        "dsa_indexer_topk_freq",
        "dsa_indexer_skip_topk_offset",
        "dsa_indexer_loss_coeff",
        "dsa_indexer_use_sparse_loss",
        "dsa_kernel_backend",
        "dsa_indexer_rope_interleaved",
        "dsa_indexer_rotate_activation",
        "dsa_indexer_scoring_relu",
        "dsa_indexer_k_norm_epsilon",
        "dsa_indexer_k_norm_fp32",
    ),
    "linear attention (gated delta net)": (
        "linear_attention_freq",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    ),
    "meta-device initialisation": ("init_model_with_meta_device",),
    "maximal update parametrisation (muP)": (
        "use_mup",
        "mup_width_mult",
        "mup_base_hidden_size",
        "mup_embedding_mult",
        "mup_output_mult",
        "mup_base_head_dim",
        "mup_attn_scale_power",
    ),
    "FP8 parameters, FP8 output layer, FP8 attention and custom FP8 recipes": (
        "fp8_param",
        "fp8_quantizer_factory",
        "fp8_output_proj",
        "fp8_dot_product_attention",
        "fp8_multi_head_attention",
        "activation_func_fp8_input_store",
    ),
    "FP4 training": ("fp4", "fp4_recipe", "fp4_param", "fp4_quantizer_factory"),
    "Kitchen quantization": ("use_kitchen", "use_kitchen_attention", "kitchen_attention_backend", "quant_recipe"),
    "CUDA graphs": (
        "enable_cuda_graph",
        "cuda_graph_use_single_mempool",
        "cuda_graph_retain_backward_graph",
        "cuda_graph_warmup_steps",
        "external_cuda_graph",
        "cuda_graph_impl",
        "inference_cuda_graph_scope",
        "cuda_graph_scope",
    ),
    "inference-only execution options": (
        "flash_decode",
        "inference_rng_tracker",
        "inference_sampling_seed",
        "nccl_all_reduce_for_prefill",
        "use_inference_optimized_layers",
        "inference_fuse_tp_communication",
        "inference_disable_triton_nvls_kernels",
        "inference_grouped_gemm_backend",
        "inference_moe_disable_fused_quant_kernels",
        "inference_moe_token_dispatcher_type",
        "mlp_chunks_for_prefill",
        "cache_mla_latents",
    ),
    "chunked MLP": ("mlp_chunks_for_training",),
    "batch-invariant kernels": ("batch_invariant_mode",),
    "config logger": ("config_logger_dir",),
    "heterogeneous layers": ("heterogeneous_block_specs", "hetereogenous_dist_checkpoint"),
}
"""Feature -> the config fields that must keep their default until the feature is built."""


def _field_defaults(config_class: type) -> Dict[str, object]:
    defaults = {}
    for field in dataclasses.fields(config_class):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
    return defaults


def _is_default(value, default) -> bool:
    # Megatron reads these switches by truth value, and its own tests pass ``fp8=False`` to mean "off" where the
    # default is None, so False counts as the default None.
    return value == default or (default is None and value is False)


def refuse_features_not_supported_yet(config) -> None:
    """Raise one ValueError listing every field of ``NOT_SUPPORTED_YET`` that ``config`` sets away from its default.

    Defaults are those of ``config``'s own class, so a subclass that turns a feature on by default (Megatron's
    ``MLATransformerConfig``) still constructs; the model code refuses to build that feature instead.
    """
    defaults = _field_defaults(type(config))
    problems = []
    for feature, names in NOT_SUPPORTED_YET.items():
        changed = [
            f"{name}={getattr(config, name)!r}"
            for name in names
            if name in defaults and not _is_default(getattr(config, name), defaults[name])
        ]
        if changed:
            problems.append(f"{feature} ({', '.join(changed)})")
    if problems:
        raise ValueError(
            "not supported yet: " + "; ".join(problems) + ". Leave these fields at their defaults "
            "(this project does not build those features yet)"
        )
