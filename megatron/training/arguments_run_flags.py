"""Megatron-LM's flags for training, checkpointing, distribution and data options this project does not have.

Tables of training-run options not built yet (hybrid context parallelism, FSDP, offloading, ...) and
GPU/NCCL/checkpoint-I/O tuning. Each row holds Megatron-LM's option strings, dest, type, default, choices and nargs;
the table says what a non-default value does here (refused by validate_args, or ignored with a warning). Named types
(``"moe_freq_type"``) are Megatron-LM's argparse types, defined in ``megatron.training.arguments``.
"""

from megatron.training.arguments_support import FlagTable, off_switch, switch, value

CONTEXT_PARALLEL = FlagTable(
    "distributed",
    (
        value(
            "--cp-comm-type",
            str,
            ["p2p"],
            nargs="+",
            help="How context-parallel attention exchanges keys/values: p2p (ring), all_gather, a2a (Ulysses head "
            "scatter) or a2a+p2p (hierarchical); one value, or one per layer.",
        ),
        value(
            "--hierarchical-context-parallel-sizes",
            int,
            None,
            nargs="+",
            help="Group sizes of hierarchical context parallelism for --cp-comm-type a2a+p2p: the a2a group size "
            "and the p2p (ring) size, whose product is --context-parallel-size.",
        ),
    ),
)

HYBRID_CONTEXT_PARALLEL = FlagTable(
    "distributed",
    (
        switch("--hybrid-context-parallel"),
        value("--max-seqlen-per-dp-cp-rank", int, None),
    ),
    not_supported="hybrid context parallelism",
)


MEGATRON_FSDP = FlagTable(
    "distributed",
    (
        switch(
            "--use-megatron-fsdp",
            help="Wrap the model in Megatron FSDP (megatron.core.distributed.fsdp.FullyShardedDataParallel); "
            "--data-parallel-sharding-strategy says what is sharded over data-parallel ranks.",
        ),
        switch(
            "--fsdp-double-buffer",
            help="Megatron FSDP, optim_grads_params: Megatron's two alternating gather buffers (accepted; gathered "
            "parameters are allocated per FSDP unit when it runs and freed after).",
        ),
        value(
            "--megatron-fsdp-grad-comm-dtype",
            None,
            "auto",
            choices=["fp32", "fp16", "bf16", "auto"],
            help="Megatron FSDP (optim_grads, optim_grads_params): dtype of the gradient reduce-scatter "
            "(auto: the main-gradient dtype).",
        ),
        value(
            "--megatron-fsdp-main-grads-dtype",
            None,
            "auto",
            choices=["fp32", "bf16", "fp16", "auto"],
            help="Megatron FSDP: dtype of the gradient buffers and shards (auto: fp32 with --accumulate-allreduce-"
            "grads-in-fp32, else the parameters' dtype).",
        ),
        value(
            "--megatron-fsdp-main-params-dtype",
            None,
            "fp32",
            choices=["fp32", "bf16", "fp16", "auto"],
            help="Megatron FSDP: dtype of the optimizer's main parameters (only fp32 is supported).",
        ),
    ),
)


FSDP = FlagTable(
    "distributed",
    (
        switch("--enable-full-sharding-in-hsdp"),
        switch("--fsdp-db-use-persist-buf-on-alloc-fail"),
        switch("--fsdp-manual-registration"),
        switch("--init-model-with-meta-device"),
        switch("--megatron-fsdp-enable-fine-grained-param-gather"),
        switch("--megatron-fsdp-max-pool-double-buffer"),
        off_switch("--no-strict-fsdp-dtensor-load, --disable-strict-fsdp-dtensor-load", "strict_fsdp_dtensor_load"),
        value("--outer-dp-sharding-strategy", str, "no_shard", choices=["no_shard", "optim"]),
        value("--suggested-communication-unit-size", int, None),
    ),
    not_supported="FSDP (Megatron FSDP / torch FSDP2)",
)


TORCH_FSDP2 = FlagTable(
    "distributed",
    (
        off_switch(
            "--torch-fsdp2-no-reshard-after-forward",
            "torch_fsdp2_reshard_after_forward",
            help="With --use-torch-fsdp2: keep each layer's gathered parameters from its forward until its backward "
            "instead of freeing them and gathering them again (more memory, one all-gather less per layer).",
        ),
        switch(
            "--use-torch-fsdp2",
            help="Fully sharded data parallelism through PyTorch FSDP2 (torch.distributed.fsdp.fully_shard) applied "
            "to each transformer layer and the whole model: parameters, gradients and optimizer state sharded over "
            "the data-parallel (x context-parallel) ranks as DTensors. Needs --untie-embeddings-and-output-weights "
            "and --ckpt-format torch_dist; not with pipeline or expert parallelism or --use-distributed-optimizer.",
        ),
    ),
)


COMMUNICATOR_TUNING = FlagTable(
    "distributed",
    (
        switch("--create-all-gather-group"),
        off_switch("--disable-gloo-process-groups", "use_gloo_process_groups"),
        switch("--fake-process-group"),
        value("--flight-recorder-dump-path", str, None),
        switch("--flight-recorder-include-stack-trace"),
        value("--flight-recorder-trace-buffer-size", int, 2000),
        value("--high-priority-stream-groups", str, [], nargs="+"),
        value("--nccl-communicator-config-path", str, None),
        off_switch(
            "--no-flight-recorder-dump-on-timeout, --disable-flight-recorder-dump-on-timeout",
            "flight_recorder_dump_on_timeout",
        ),
        off_switch(
            "--no-flight-recorder-extra-dump-on-exec, --disable-flight-recorder-extra-dump-on-exec",
            "flight_recorder_extra_dump_on_exec",
        ),
        off_switch(
            "--no-flight-recorder-include-only-active, --disable-flight-recorder-include-only-active",
            "flight_recorder_include_only_active",
        ),
        value("--pipeline-model-parallel-comm-backend", str, None, choices=["nccl", "ucc"]),
        value("--sharp-enabled-group", str, None, choices=["dp", "dp_replica"]),
        switch("--use-ring-exchange-p2p"),
        switch("--use-sharp"),
    ),
    no_effect="NCCL / communicator tuning",
)


DISTRIBUTED_OPTIONS = FlagTable(
    "distributed",
    (
        value("--distributed-timeout-seconds-after-init", int, None),
        switch("--lazy-mpu-init"),
        switch("--use-tp-pp-dp-mapping"),
    ),
    not_supported="distributed option",
)


WEIGHT_SHARDING = FlagTable(
    "distributed",
    (value("--tensor-parallel-num-weight-shards", int, None),),
    not_supported="tensor-parallel weight sharding (GTP)",
)


OPTIMIZER_CPU_OFFLOAD = FlagTable(
    "training",
    (
        off_switch(
            "--no-pin-cpu-grads",
            "pin_cpu_grads",
            help="With --optimizer-cpu-offload: do not page-lock the host gradient buffers (pinning needs CUDA).",
        ),
        off_switch(
            "--no-pin-cpu-params",
            "pin_cpu_params",
            help="With --optimizer-cpu-offload: do not page-lock the host parameter copies (pinning needs CUDA).",
        ),
        switch(
            "--optimizer-cpu-offload",
            help="Step --optimizer-offload-fraction of the parameters (their optimizer state, host copies and "
            "gradients) in host memory (megatron.core.optimizer.cpu_offloading.HybridDeviceOptimizer).",
        ),
        value(
            "--optimizer-offload-fraction",
            float,
            1.0,
            help="Fraction in [0, 1] of the parameters (by element count) stepped on the host with "
            "--optimizer-cpu-offload.",
        ),
        switch(
            "--overlap-cpu-optimizer-d2h-h2d",
            help="With --optimizer-cpu-offload: copy gradients to the host on a side CUDA stream while the device "
            "part steps (no effect without CUDA).",
        ),
        switch(
            "--use-torch-optimizer-for-cpu-offload",
            help="With --optimizer-cpu-offload: step both parts with torch's optimizers (always so here).",
        ),
    ),
)


ACTIVATION_OFFLOADING = FlagTable(
    "training",
    (
        value(
            "--cpu-offloading-num-layers",
            int,
            0,
            help="Offload the activations the first N transformer layers save for backward to host memory.",
        ),
        switch(
            "--fine-grained-activation-offloading",
            help="Offload the activations that the modules named by --offload-modules save for backward to host "
            "memory (tensors of at least --min-offloaded-tensor-size elements).",
        ),
        value(
            "--min-offloaded-tensor-size",
            int,
            1048576,
            help="Smallest saved tensor (in elements) that --fine-grained-activation-offloading moves to the host.",
        ),
        value(
            "--offload-modules",
            str,
            [],
            nargs="+",
            help="Modules whose saved activations --fine-grained-activation-offloading moves to the host: "
            "attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1.",
        ),
    ),
)


ACTIVATION_OFFLOADING_TUNING = FlagTable(
    "training",
    (
        value("--activation-offload-fraction", float, 1.0),
        switch("--cpu-offloading-retain-pinned-cpu-buffers"),
        value("--delta-offload-bytes-across-pp-ranks", int, 0),
        value("--fine-grained-offloading-max-inflight-offloads", int, None),
    ),
    not_supported="activation offloading tuning",
)


PRECISION_AWARE_OPTIMIZER = FlagTable(
    "training",
    (
        value(
            "--exp-avg-dtype",
            None,
            "fp32",
            choices=["fp32", "fp16", "bf16", "fp8"],
            help="With --use-precision-aware-optimizer: storage dtype of Adam's first moment (fp8 needs --fp8-format).",
        ),
        value(
            "--exp-avg-sq-dtype",
            None,
            "fp32",
            choices=["fp32", "fp16", "bf16", "fp8"],
            help="With --use-precision-aware-optimizer: storage dtype of Adam's second moment (fp8 needs "
            "--fp8-format).",
        ),
        value(
            "--main-grads-dtype",
            None,
            "fp32",
            choices=["fp32", "bf16"],
            help="With --use-precision-aware-optimizer: dtype of the main gradients the optimizer reads.",
        ),
        value(
            "--main-params-dtype",
            None,
            "fp32",
            choices=["fp32", "fp16"],
            help="With --use-precision-aware-optimizer: storage dtype of the main parameters (fp16 needs --bf16 or "
            "--fp16).",
        ),
        switch(
            "--use-precision-aware-optimizer",
            help="Keep the distributed optimizer's main params, main grads and Adam moments in --main-params-dtype, "
            "--main-grads-dtype, --exp-avg-dtype and --exp-avg-sq-dtype, computing the update in fp32.",
        ),
    ),
)


# Read by --optimizer lion and --muon-scalar-optimizer lion (inert with the other optimizers, as in Megatron-LM).
LION_OPTIONS = FlagTable(
    "training",
    (
        value("--lion-beta1", float, 0.95, help="Lion: beta interpolating momentum and gradient for the sign update."),
        value("--lion-beta2", float, 0.98, help="Lion: decay of the momentum."),
    ),
)


# Read by --optimizer muon / dist_muon (inert with the other optimizers, as in Megatron-LM).
MUON_OPTIONS = FlagTable(
    "training",
    (
        value(
            "--muon-coefficient-type",
            str,
            "quintic",
            help="Muon: Newton-Schulz coefficients: quintic (5-step schedule), simple (Keller Jordan's, every step), "
            "polar_express (8 or more steps) or aol.",
        ),
        value(
            "--muon-extra-scale-factor", float, 1.0, help="Muon: extra factor on the update (0.2 matches AdamW's RMS)."
        ),
        value(
            "--muon-fp32-matmul-prec",
            str,
            "medium",
            choices=["low", "medium", "high"],
            help="Muon: precision of the Newton-Schulz matmuls: high runs them in fp32, medium and low in bf16.",
        ),
        value("--muon-momentum", float, 0.9, help="Muon: momentum (EMA) coefficient."),
        switch("--muon-nesterov", help="Muon: Nesterov momentum."),
        off_switch(
            "--muon-no-split-qkv",
            "muon_split_qkv",
            help="Muon: orthogonalise linear_qkv whole instead of as its q, k and v matrices.",
        ),
        value(
            "--muon-num-ns-steps",
            int,
            5,
            help="Muon: Newton-Schulz steps (a multiple of 5 for quintic, of 4 for aol, at least 8 for polar_express).",
        ),
        value(
            "--muon-scalar-optimizer",
            str,
            "adam",
            choices=["adam", "lion"],
            help="Muon: optimizer of embeddings, output layer, biases and norms.",
        ),
        value(
            "--muon-scale-mode",
            str,
            "spectral",
            choices=["spectral", "unit_rms_norm", "shape_scaling"],
            help="Muon: update scale: sqrt(max(out, in)), sqrt(out / in) or sqrt(max(1, out / in)).",
        ),
        value(
            "--muon-tp-mode",
            str,
            "blockwise",
            choices=["blockwise", "duplicated", "distributed"],
            help="Muon under tensor parallelism: orthogonalise each shard alone (blockwise), the gathered matrix on "
            "every rank (duplicated), or with the Newton-Schulz matmuls split over the TP ranks (distributed).",
        ),
    ),
)


TRAINING_OPTIONS = FlagTable(
    "training",
    (
        value("--check-weight-hash-across-dp-replicas-interval", int, None),
        value("--ddp-num-buckets", int, None),
        value("--ddp-param-name-patterns-for-fp32-local-accumulation", None, [], nargs="+"),
        switch("--ddp-reduce-scatter-with-fp32-accumulation"),
        switch("--defer-embedding-wgrad-compute"),
        switch("--enable-experimental"),
        switch("--exit-signal-handler-for-dataloader"),
        switch("--exit-signal-handler-for-training"),
        switch("--freeze-all-layers"),
        value("--head-lr-mult", float, 1.0),
        value("--iterations-to-skip", int, [], nargs="+"),
        value("--mlp-chunks-for-training", int, 1),
        off_switch("--no-use-layer-wise-param-layout", "use_layer_wise_param_layout"),
        switch("--overlap-param-gather-with-optimizer-step"),
        switch("--replication"),
        value("--replication-factor", int, 2),
        value("--replication-jump", int, None),
        switch("--test-mode"),
        value("--train-sync-interval", int, None),
        off_switch("--use-same-sampling-seed-across-dp-ranks", "offset_sampling_seed_by_dp_rank"),
        value("--wgrad-deferral-limit", int, 0),
    ),
    not_supported="training option",
)


CUDA_PROFILING = FlagTable(
    "training",
    (
        value("--memory-snapshot-path", str, "snapshot.pickle"),
        switch("--nvtx-ranges"),
        switch("--profile"),
        value("--profile-ranks", int, [], nargs="+"),
        value("--profile-step-end", int, 12),
        value("--profile-step-start", int, 10),
        switch("--record-memory-history"),
    ),
    no_effect="CUDA profiler (nsys) and memory-history hooks",
)


PYTORCH_PROFILER = FlagTable(
    "training",
    (
        switch("--pytorch-profiler-collect-callstack"),
        switch("--pytorch-profiler-collect-chakra"),
        switch("--pytorch-profiler-collect-shapes"),
        switch("--record-shapes"),
        switch("--use-pytorch-profiler"),
    ),
    not_supported="PyTorch profiler",
)


CHECKPOINT_LOAD_STRICTNESS = FlagTable(
    "checkpointing",
    (
        value(
            "--dist-ckpt-strictness",
            str,
            "assume_ok_unexpected",
            choices=[
                "assume_ok_unexpected",
                "log_unexpected",
                "log_all",
                "raise_unexpected",
                "raise_all",
                "return_unexpected",
                "return_all",
                "ignore_all",
            ],
        ),
    ),
    no_effect="loads check the checkpoint's keys in Megatron-LM's default mode, assume_ok_unexpected",
)


CHECKPOINT_IO_TUNING = FlagTable(
    "checkpointing",
    (
        value("--async-ckpt-cpu-priority", int, 10),
        value("--async-ckpt-io-priority", int, 3),
        switch("--async-ckpt-use-cpu-shm"),
        value("--async-strategy", str, "nvrx", choices=["nvrx", "mcore"]),
        switch("--ckpt-assume-constant-structure"),
        value(
            "--ckpt-fully-parallel-load-exchange-algo",
            str,
            "broadcast",
            choices=["broadcast", "gather_rounds", "gather_object"],
        ),
        value("--ckpt-fully-parallel-load-process-group", str, "dp", choices=["dp", "ep_dp"]),
        value("--ckpt-fully-parallel-save-process-group", str, "dp", choices=["dp", "ep_dp"]),
        value("--dist-ckpt-format", None, None, dest="dist_ckpt_format_deprecated"),
        value("--dist-ckpt-workers", int, 1),
        off_switch(
            "--no-ckpt-load-validate-sharding-integrity, --disable-ckpt-load-validate-sharding-integrity",
            "ckpt_load_validate_sharding_integrity",
        ),
        off_switch("--no-stream-ckpt-dequant, --disable-stream-ckpt-dequant", "stream_ckpt_dequant"),
        switch("--use-dist-ckpt", dest="use_dist_ckpt_deprecated"),
        switch("--use-persistent-ckpt-worker"),
        switch("--verify-integrity"),
    ),
    no_effect="checkpoint I/O tuning of Megatron-Core's savers and loaders",
)


CHECKPOINT_OPTIONS = FlagTable(
    "checkpointing",
    (
        switch("--ckpt-convert-update-legacy-dist-opt-format"),
        switch("--dist-ckpt-save-pre-mcore-014"),
        switch("--load-main-params-from-ckpt"),
        value("--non-persistent-ckpt-type", str, None, choices=["global", "local", "in_memory"]),
        value("--non-persistent-global-ckpt-dir", str, None),
        value("--non-persistent-local-ckpt-algo", str, "fully_parallel", choices=["fully_parallel", "atomic"]),
        value("--non-persistent-local-ckpt-dir", str, None),
        value("--non-persistent-save-interval", int, None),
        value("--override-ckpt-iteration", int, None),
        value("--save-retain-interval", int, None),
    ),
    not_supported="checkpointing option",
)


LOGGING_OPTIONS = FlagTable(
    "logging",
    (
        value("--config-logger-dir", str, ""),
        value("--dump-param-to-param-group-map", str, None),
        value("--gpu-sniff-test-interval", int, None),
        switch("--log-device-memory-used"),
        switch("--log-energy"),
        switch("--log-max-attention-logit"),
        value("--log-memory-interval", int, None),
        value("--save-activations-interval", int, None),
        value("--save-dgrads-interval", int, None),
        value("--save-params-interval", int, None),
        value("--save-wgrads-interval", int, None),
    ),
    not_supported="logging option",
)


DATA_OPTIONS = FlagTable(
    "data and dataloader",
    (
        switch("--allow-ambiguous-pad-tokens"),
        switch("--dataloader-defer-npy-index-mmap"),
        switch("--dataloader-fast-cache-load"),
        switch("--dataloader-inter-document-masking"),
        off_switch("--no-data-sharding", "data_sharding"),
        value("--per-dataset-sequences-path", None, None),
        value("--phase-transition-iterations", str, None),
        value("--sample-rate", float, 1.0),
    ),
    not_supported="data option",
)


VALIDATION_OPTIONS = FlagTable(
    "validation",
    (
        value("--eval-global-batch-size", int, None),
        value("--eval-micro-batch-size", int, None),
        switch("--full-validation"),
        switch("--multiple-validation-sets"),
        value("--start-eval-at-iter", int, None),
        value("--validation-set-names", str, None, nargs="+"),
    ),
    not_supported="validation option",
)


TOKENIZER_OPTIONS = FlagTable(
    "tokenizer",
    (
        off_switch("--no-pad-vocab-size, --disable-pad-vocab-size", "pad_vocab_size"),
        off_switch(
            "--no-tokenizer-sentencepiece-ignore-extra-whitespaces, "
            "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
            "tokenizer_sentencepiece_ignore_extra_whitespaces",
        ),
        value("--null-tokenizer-eod-id", int, None),
        value("--null-tokenizer-pad-id", int, -1),
        value("--padded-vocab-size", int, None),
        switch("--tokenizer-hf-no-include-special-tokens"),
        switch("--tokenizer-hf-no-use-fast"),
        value("--tokenizer-metadata", str, None, dest="metadata_path"),
        switch("--tokenizer-sentencepiece-legacy"),
        value("--tokenizer-special-tokens", str, None, dest="special_tokens", nargs="+"),
        switch("--trust-remote-code"),
    ),
    not_supported="tokenizer option",
)


# The tokenizer flags the text generation server reads.
CHAT_TEMPLATE = FlagTable(
    "tokenizer",
    (
        value(
            "--chat-template",
            str,
            None,
            help="A Jinja chat template file for the server's chat completions (replaces the tokenizer's own).",
        ),
    ),
)


FILL_IN_THE_MIDDLE = FlagTable(
    "data and dataloader",
    (
        switch("--fim-data"),
        value("--fim-eod-token", str, "<|endoftext|>"),
        value("--fim-fragment-rate", float, None),
        value("--fim-middle-token", str, "<fim_middle>"),
        value("--fim-no-prefix", str, None),
        value("--fim-pad-token", str, "<fim_pad>"),
        value("--fim-prefix-token", str, "<fim_prefix>"),
        value("--fim-rate", float, 0.5),
        value("--fim-split-sample", str, None),
        value("--fim-spm-rate", float, 0.5),
        value("--fim-suffix-token", str, "<fim_suffix>"),
    ),
    not_supported="fill-in-the-middle (FIM) data",
)


TABLES = (
    CONTEXT_PARALLEL,
    HYBRID_CONTEXT_PARALLEL,
    MEGATRON_FSDP,
    FSDP,
    TORCH_FSDP2,
    COMMUNICATOR_TUNING,
    DISTRIBUTED_OPTIONS,
    WEIGHT_SHARDING,
    OPTIMIZER_CPU_OFFLOAD,
    ACTIVATION_OFFLOADING,
    ACTIVATION_OFFLOADING_TUNING,
    PRECISION_AWARE_OPTIMIZER,
    LION_OPTIONS,
    MUON_OPTIONS,
    TRAINING_OPTIONS,
    CUDA_PROFILING,
    PYTORCH_PROFILER,
    CHECKPOINT_LOAD_STRICTNESS,
    CHECKPOINT_IO_TUNING,
    CHECKPOINT_OPTIONS,
    LOGGING_OPTIONS,
    DATA_OPTIONS,
    VALIDATION_OPTIONS,
    TOKENIZER_OPTIONS,
    CHAT_TEMPLATE,
    FILL_IN_THE_MIDDLE,
)
