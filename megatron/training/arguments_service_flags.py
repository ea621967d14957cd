"""Megatron-LM's flags for inference, RL and vendor services (see arguments_support).

Tables of the inference engine, RL, and NVIDIA services (resiliency extension, one-logger, ...). Each row holds
Megatron-LM's option strings, dest, type, default, choices and nargs; the table says what a non-default value does
here (refused by validate_args, or ignored with a warning). Named types (``"moe_freq_type"``) are Megatron-LM's
argparse types, defined in ``megatron.training.arguments``.
"""

from megatron.training.arguments_support import FlagTable, bool_optional, off_switch, switch, value

INFERENCE = FlagTable(
    "inference",
    (
        switch("--decode-only-cuda-graphs"),
        switch("--enable-chunked-prefill"),
        switch("--flash-decode"),
        value("--inference-batch-times-seqlen-threshold", int, -1),
        value("--inference-coordinator-port", int, None),
        switch("--inference-cuda-graph-all-prefills"),
        value("--inference-cuda-graph-max-tokens", int, 512),
        value("--inference-cuda-graph-scope", str, None, choices=["none", "layer", "block"]),
        bool_optional("--inference-disable-ep-consensus"),
        switch("--inference-disable-triton-nvls-kernels"),
        switch("--inference-dynamic-batching"),
        value("--inference-dynamic-batching-async-sched-mode", str, "legacy", choices=["legacy", "async"]),
        value("--inference-dynamic-batching-cuda-graph-mixed-prefill-count", int, 16),
        value(
            "--inference-dynamic-batching-cuda-graph-sizing-distribution",
            str,
            "exponential",
            choices=["exponential", "linear"],
        ),
        value(
            "--inference-dynamic-batching-logprobs-mode",
            str,
            "raw_logprobs",
            choices=["raw_logprobs", "processed_logprobs"],
        ),
        value("--inference-dynamic-batching-mamba-memory-ratio", float, None),
        value("--inference-dynamic-batching-max-requests", int, None),
        value("--inference-dynamic-batching-num-cuda-graphs", int, 16),
        value("--inference-dynamic-batching-paused-buffer-size-gb", float, None),
        bool_optional(
            "--inference-dynamic-batching-prefix-caching", dest="inference_dynamic_batching_enable_prefix_caching"
        ),
        value(
            "--inference-dynamic-batching-prefix-caching-coordinator-policy",
            str,
            "load_balanced",
            choices=["longest_prefix", "first_prefix_block", "load_balanced"],
        ),
        value(
            "--inference-dynamic-batching-prefix-caching-eviction-policy", str, "ref_zero", choices=["ref_zero", "lru"]
        ),
        value("--inference-dynamic-batching-prefix-caching-mamba-gb", float, None),
        value("--inference-dynamic-batching-prefix-caching-routing-alpha", float, 0.5),
        value("--inference-dynamic-batching-sampling-backend", str, "torch", choices=["torch", "flashinfer"]),
        switch("--inference-dynamic-batching-track-generated-token-events"),
        switch("--inference-dynamic-batching-track-paused-request-events"),
        value("--inference-dynamic-batching-unified-memory-level", int, 0, choices=[0, 1]),
        switch("--inference-fuse-tp-communication"),
        value("--inference-grouped-gemm-backend", str, "vllm", choices=["flashinfer", "torch", "vllm"]),
        value("--inference-logging-step-interval", int, 0),
        switch("--inference-moe-disable-fused-quant-kernels"),
        value("--inference-moe-token-dispatcher-type", str, "nvls", choices=["nccl", "nvls"]),
        switch("--inference-rng-tracker"),
        value("--inference-shards", str, None),
        bool_optional("--inference-text-gen-server-logging"),
        bool_optional("--inference-use-synchronous-zmq-collectives"),
        bool_optional("--inference-wandb-logging"),
        value("--max-tokens-to-oom", int, 12000),
        value("--mlp-chunks-for-prefill", int, 1),
        switch("--nccl-all-reduce-for-prefill"),
        value("--num-speculative-tokens", int, 0),
        switch("--use-legacy-static-engine"),
    ),
    not_supported="inference engine",
)


# The inference flags the server and the dynamic engine read (tools/run_text_generation_server.py).
INFERENCE_ENGINE_SIZES = FlagTable(
    "inference",
    (
        value(
            "--inference-dynamic-batching-block-size",
            int,
            256,
            help="Tokens per block of the dynamic engine's paged KV cache.",
        ),
        value(
            "--inference-dynamic-batching-buffer-size-gb",
            float,
            40.0,
            help="Most KV-cache memory per rank in GB (the server allocates no more than its requests can use).",
        ),
        value(
            "--inference-dynamic-batching-max-tokens",
            int,
            None,
            help="Most tokens one engine step runs (decode tokens plus prefill chunks; default 2048).",
        ),
        value(
            "--inference-max-requests", int, 8, help="Most requests the engine runs at once; more wait in its queue."
        ),
        value(
            "--inference-max-seq-length",
            int,
            2560,
            help="Longest prompt plus generation of one request (at most --max-position-embeddings).",
        ),
    ),
)


RL = FlagTable(
    "rl",
    (
        value("--grpo-clamp-eps-lower", float, 0.01),
        value("--grpo-clamp-eps-upper", float, 0.01),
        value("--grpo-entropy-term-weight", float, 0.0),
        switch("--grpo-filter-groups-with-same-reward"),
        value("--grpo-group-size", int, 2),
        value("--grpo-iterations", int, 2),
        value("--grpo-kl-beta", float, 0.001),
        value("--grpo-prompts-per-step", int, 32),
        value("--langrl-env-config", str, None),
        switch("--perform-rl-step"),
        value("--refit-method", str, "gloo", choices=["nccl", "gloo", "nvshmem"]),
        value("--rl-consumption-granularity", str, "B", choices=["R", "G", "B"]),
        value("--rl-default-temperature", float, 1.0),
        value("--rl-default-top-k", int, -1),
        value("--rl-default-top-p", float, 0),
        value("--rl-generation-lag", int, 0),
        value("--rl-importance-sampling-truncation-coef", float, None),
        value("--rl-inference-expert-model-parallel-size", int, None),
        value("--rl-inference-expert-tensor-model-parallel-size", int, None),
        bool_optional("--rl-inference-logprobs-is-correction"),
        value("--rl-inference-model-unified-memory-level", int, 0, choices=[0, 1]),
        value("--rl-inference-parsers", None, [], nargs="*"),
        value("--rl-inference-pipeline-model-parallel-size", int, None),
        value("--rl-inference-tensor-model-parallel-size", int, None),
        value("--rl-kv-cache-management-mode", str, "persist", choices=["persist", "offload", "recompute"]),
        bool_optional("--rl-offload-inference-model-weights-when-idle"),
        switch("--rl-offload-optimizer-during-inference"),
        bool_optional("--rl-partial-rollouts"),
        bool_optional("--rl-persist-cuda-graphs"),
        switch("--rl-profile"),
        value("--rl-profile-dir", str, None),
        value("--rl-prompts-per-eval", int, 32),
        value("--rl-sequence-packing-algo", str, "fifo", choices=["fifo", "round-robin"]),
        value("--rl-sequence-packing-max-sequences-per-bin", int, 50),
        bool_optional("--rl-skip-bos-token"),
        value("--rl-submission-granularity", str, "B", choices=["R", "G", "B"]),
        bool_optional("--rl-training-cuda-graphs"),
        bool_optional("--rl-use-sequence-packing"),
        bool_optional("--rl-verify-model-weights-swap"),
    ),
    not_supported="reinforcement learning (RL / GRPO)",
)


RESILIENCY = FlagTable(
    "fault tolerance",
    (
        switch("--calc-ft-timeouts"),
        switch("--enable-ft-package"),
        value("--ft-num-warmup-iters", int, 5),
        value("--inprocess-active-world-size", int, 1),
        value("--inprocess-barrier-timeout", float, 120),
        value("--inprocess-completion-timeout", float, 120),
        switch("--inprocess-empty-cuda-cache"),
        value("--inprocess-granularity", str, "node", choices=["node", "rank"]),
        value("--inprocess-hard-timeout", float, 90),
        value("--inprocess-heartbeat-interval", float, 30),
        value("--inprocess-heartbeat-timeout", float, 60),
        value("--inprocess-last-call-wait", float, 1),
        value("--inprocess-max-iterations", int, None),
        value("--inprocess-monitor-process-interval", float, 1.0),
        value("--inprocess-monitor-thread-interval", float, 1.0),
        value("--inprocess-progress-watchdog-interval", float, 1.0),
        switch("--inprocess-restart"),
        value("--inprocess-soft-timeout", float, 60),
        value("--inprocess-termination-grace-time", float, 1),
    ),
    no_effect="NVIDIA Resiliency Extension (fault tolerance, in-process restart)",
)


STRAGGLER_DETECTOR = FlagTable(
    "straggler",
    (
        switch("--disable-straggler-on-startup"),
        switch("--log-straggler"),
        value("--straggler-ctrlr-port", int, 65535),
        value("--straggler-minmax-count", int, 1),
    ),
    no_effect="straggler detector (NVIDIA Resiliency Extension)",
)


FAULT_INJECTOR = FlagTable(
    "fault injector",
    (
        value("--fault-injector-delay-start-iteration", int, None),
        value("--fault-injector-fault-delay", float, None),
        value("--fault-injector-fault-probabilities", str, None),
        value("--fault-injector-fault-types", str, None),
        value("--fault-injector-mtti-seconds", float, None),
        value("--fault-injector-num-ranks", int, None),
        value("--fault-injector-offset-seconds", float, None),
        value("--fault-injector-ranks", str, None),
        value("--fault-injector-seed", int, None),
    ),
    no_effect="fault injector (NVIDIA Resiliency Extension)",
)


ONE_LOGGER = FlagTable(
    "one logger",
    (
        value("--app-tag-run-name", str, None),
        value("--app-tag-run-version", str, "0.0.0"),
        off_switch("--no-one-logger", "enable_one_logger"),
        switch("--one-logger-async"),
        value("--one-logger-project", str, "megatron-lm"),
        value("--one-logger-run-name", str, None),
    ),
    no_effect="one-logger telemetry",
)


MULTI_STORAGE_CLIENT = FlagTable(
    "msc",
    (
        switch("--disable-msc", dest="disable_msc_deprecated"),
        switch("--enable-msc"),
        value("--object-storage-cache-path", str, None),
    ),
    no_effect="Multi-Storage Client",
)


AUTORESUME = FlagTable(
    "autoresume",
    (
        switch("--adlr-autoresume"),
        value("--adlr-autoresume-interval", int, 1000),
    ),
    no_effect="ADLR autoresume (NVIDIA cluster service)",
)


WORKLOAD_INSPECTOR = FlagTable(
    "workload inspector", (switch("--run-workload-inspector-server"),), no_effect="workload inspector server"
)


RERUN_STATE_MACHINE = FlagTable(
    "rerun engine",
    (
        switch("--check-for-large-grads"),
        switch("--check-for-spiky-loss"),
        value("--error-injection-rate", int, 0),
        value(
            "--error-injection-type",
            str,
            "transient_error",
            choices=["correct_result", "transient_error", "persistent_error"],
        ),
        value("--rerun-mode", str, "validate_results", choices=["disabled", "validate_results", "report_stats"]),
        value("--result-rejected-tracker-filename", str, None),
    ),
    not_supported="rerun state machine (result validation, spiky-loss checks, error injection)",
)


LOGIT_DISTILLATION = FlagTable(
    "distillation",
    (
        value("--logits-load-decode-threads", int, 4),
        value("--logits-load-dir", str, None),
        switch("--logits-load-ignore-errors"),
        value("--logits-load-kd-loss-alpha", float, 1.0),
        value("--logits-load-msc-prefetch-depth", int, 2),
        value("--logits-load-prefetch-factor", int, 3),
        value("--logits-save-dir", str, None),
        value("--logits-save-dtype", str, "fp16", choices=["fp16", "bf16", "fp32"]),
        value("--logits-save-top-k", int, None),
        value("--logits-save-top-p", float, None),
        value("--logits-save-top-p-min-k", int, 1),
    ),
    not_supported="logit saving / knowledge distillation",
)


SFT = FlagTable(
    "sft",
    (
        switch("--sft"),
        value("--sft-tokenizer-prompt-format", str, "nemotron-h-aligned"),
    ),
    not_supported="supervised fine-tuning (SFT) data",
)


TABLES = (
    INFERENCE_ENGINE_SIZES,
    INFERENCE,
    RL,
    RESILIENCY,
    STRAGGLER_DETECTOR,
    FAULT_INJECTOR,
    ONE_LOGGER,
    MULTI_STORAGE_CLIENT,
    AUTORESUME,
    WORKLOAD_INSPECTOR,
    RERUN_STATE_MACHINE,
    LOGIT_DISTILLATION,
    SFT,
)
