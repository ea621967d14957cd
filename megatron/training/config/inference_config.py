"""``InferenceSetupConfig``: the inference settings of an ``InferenceConfigContainer``, one field per Megatron-LM
inference argument (``--inference-max-requests`` is ``inference_max_requests``, and so on).

It is plain data that can be written to YAML before any model exists; ``to_inference_config`` turns it, with the
built model, into the ``megatron.core.inference.config.InferenceConfig`` the dynamic engine takes.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.transformer.module import MegatronModule


@dataclass(kw_only=True)
class InferenceSetupConfig:
    """Settings of the static and dynamic inference engines, with Megatron-LM 0.19's names and defaults."""

    # The static engine and general limits.
    inference_batch_times_seqlen_threshold: int = -1
    max_tokens_to_oom: int = 12000
    output_bert_embeddings: bool = False
    bert_embedder_type: Literal["megatron", "huggingface"] = "megatron"
    cuda_graph_modules: list[str] = field(default_factory=list)
    use_legacy_static_engine: bool = False
    inference_max_requests: int = 8
    inference_max_seq_length: int = 2560

    # The dynamic engine's KV-cache buffer and batch limits.
    inference_dynamic_batching: bool = False
    inference_dynamic_batching_buffer_size_gb: float = 40.0
    inference_dynamic_batching_paused_buffer_size_gb: float | None = None
    inference_dynamic_batching_mamba_memory_ratio: float | None = None
    inference_dynamic_batching_block_size: int = 256
    inference_dynamic_batching_max_requests: int | None = None
    inference_dynamic_batching_max_tokens: int | None = None

    # CUDA-graph capture, request tracking, sampling and scheduling.
    inference_dynamic_batching_num_cuda_graphs: int = 16
    inference_dynamic_batching_track_paused_request_events: bool = False
    inference_dynamic_batching_track_generated_token_events: bool = False
    inference_dynamic_batching_unified_memory_level: Literal[0, 1] = 0
    inference_dynamic_batching_cuda_graph_mixed_prefill_count: int = 16
    inference_dynamic_batching_cuda_graph_sizing_distribution: Literal["exponential", "linear"] = "exponential"
    inference_dynamic_batching_sampling_backend: Literal["torch", "flashinfer"] = "flashinfer"
    offset_sampling_seed_by_dp_rank: bool = True
    inference_dynamic_batching_async_sched_mode: Literal["legacy", "async"] = "legacy"
    inference_dynamic_batching_logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    decode_only_cuda_graphs: bool = False
    inference_cuda_graph_all_prefills: bool = False
    inference_cuda_graph_max_tokens: int = 512
    enable_chunked_prefill: bool = False
    num_speculative_tokens: int = 0

    # Prefix caching: reuse of KV blocks shared by prompts.
    inference_dynamic_batching_enable_prefix_caching: bool = False
    inference_dynamic_batching_prefix_caching_eviction_policy: Literal["ref_zero", "lru"] = "ref_zero"
    inference_dynamic_batching_prefix_caching_coordinator_policy: Literal[
        "longest_prefix", "first_prefix_block", "load_balanced"
    ] = "load_balanced"
    inference_dynamic_batching_prefix_caching_routing_alpha: float = 0.5
    inference_dynamic_batching_prefix_caching_mamba_gb: float | None = None

    # Logging and coordination.
    inference_logging_step_interval: int = 0
    inference_text_gen_server_logging: bool = False
    inference_wandb_logging: bool = False
    inference_coordinator_port: int | None = None
    inference_use_synchronous_zmq_collectives: bool = False
    inference_disable_ep_consensus: bool = False

    # Mamba state dtypes, log-probs and fused RoPE.
    mamba_inference_conv_states_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    mamba_inference_ssm_states_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    return_log_probs: bool = False
    skip_prompt_log_probs: bool = False
    use_flashinfer_fused_rope: bool = False

    def to_inference_config(
        self,
        model: "MegatronModule",
        *,
        pg_collection: Any = None,
        kv_cache_management_mode: str = "persist",
        static_kv_memory_pointers: bool = False,
        enable_cuda_graphs: bool = True,
        metrics_writer: Any = None,
        verbose: bool = True,
    ) -> "InferenceConfig":
        """The dynamic engine's ``InferenceConfig`` for ``model`` (wrappers such as DDP are looked through).

        The sequence limit is ``inference_max_seq_length``, capped by the model's ``max_sequence_length`` when
        positions are learned embeddings (a longer context would index past the table), and at least
        ``inference_dynamic_batching_max_requests``. This project's ``InferenceConfig`` holds the KV-cache sizes
        only: it has no CUDA graphs, suspend/offload or metrics writer, so ``enable_cuda_graphs``, ``verbose`` and
        ``pg_collection`` change nothing, and the settings that would need the missing features are refused.
        """
        from megatron.core.inference.config import InferenceConfig
        from megatron.core.utils import get_attr_wrapped_model

        unsupported = {
            "kv_cache_management_mode": kv_cache_management_mode != "persist",
            "static_kv_memory_pointers": static_kv_memory_pointers,
            "metrics_writer": metrics_writer is not None,
        }
        refused = [name for name, used in unsupported.items() if used]
        if refused:
            raise ValueError(
                f"InferenceSetupConfig.to_inference_config: {refused} are not supported by this project's dynamic "
                "engine (no KV-cache offload, fixed KV pointers or metrics writer); leave them at their defaults"
            )
        max_sequence_length = self.inference_max_seq_length
        max_requests = self.inference_dynamic_batching_max_requests
        if get_attr_wrapped_model(model, "position_embedding_type") == "learned_absolute":
            model_limit = get_attr_wrapped_model(model, "max_sequence_length")
            if max_requests is not None and max_requests > model_limit:
                raise ValueError(
                    f"InferenceSetupConfig: inference_dynamic_batching_max_requests={max_requests} exceeds the "
                    f"model's max_sequence_length={model_limit} (learned position embeddings); lower it"
                )
            max_sequence_length = min(model_limit, max_sequence_length) if max_sequence_length else model_limit
        if max_requests is not None:
            max_sequence_length = max(max_sequence_length, max_requests)
        sizes = {"max_requests": max_requests} if max_requests is not None else {}
        return InferenceConfig(
            max_sequence_length=max_sequence_length,
            buffer_size_gb=self.inference_dynamic_batching_buffer_size_gb,
            block_size_tokens=self.inference_dynamic_batching_block_size,
            max_tokens=self.inference_dynamic_batching_max_tokens,
            **sizes,
        )
