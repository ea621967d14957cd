"""Megatron-LM's flags for model features and GPU kernels this project does not have (see arguments_support).

Tables of model architecture features not built yet (MoE, MLA, MTP, ...), of the Mamba / hybrid flags (which
work) and GPU-only precision/kernel knobs.
Each row holds Megatron-LM's option strings, dest, type, default, choices and nargs; the table says what a non-
default value does here (refused by validate_args, or ignored with a warning). Named types (``"moe_freq_type"``) are
Megatron-LM's argparse types, defined in ``megatron.training.arguments``.
"""

from megatron.training.arguments_support import FlagTable, off_switch, switch, value

# The MoE flags that work are generated from TransformerConfig's fields in arguments._add_moe_args; these are the
# MoE features that are not built (DeepEP/HybridEP dispatch, upcycling, routing traces, paged stashing, ...).
MOE = FlagTable(
    "moe",
    (
        switch("--delay-wgrad-compute"),
        switch("--ep-overlap-early-attn-memory-release"),
        value("--expert-tensor-parallel-num-weight-shards", int, None),
        switch("--high-priority-a2a-comm-stream"),
        value("--moe-deepep-num-sms", int, None),
        switch("--moe-enable-deepep"),
        switch("--moe-enable-routing-replay"),
        value("--moe-expert-rank-capacity-factor", float, None),
        value("--moe-flex-dispatcher-backend", str, "deepep", choices=["deepep", "hybridep", "ncclep"]),
        value("--moe-flex-dispatcher-num-sms", int, None),
        value("--moe-hybridep-num-blocks-permute", int, None),
        value("--moe-hybridep-num-blocks-unpermute", int, None),
        value("--moe-hybridep-num-sms", int, None),
        value("--moe-hybridep-num-sms-preprocessing", int, 108),
        switch("--moe-hybridep-pad-uneven-dispatch-inputs"),
        value("--moe-latent-size", int, None),
        value("--moe-mlp-glu-interleave-size", int, None),
        switch("--moe-ncclep-static-shape"),
        switch("--moe-ncclep-zero-copy"),
        switch("--moe-pad-experts-for-cuda-graph-inference"),
        switch("--moe-paged-stash"),
        value("--moe-paged-stash-buffer-size-factor-cpu", float, 0.0),
        value("--moe-paged-stash-buffer-size-factor-cuda", float, 1.1),
        value("--moe-paged-stash-page-size", int, 64),
        switch("--moe-permute-fusion-into-hybridep"),
        value("--moe-router-force-biased", float, None),
        switch("--moe-router-padding-for-fp8"),
        switch("--moe-router-padding-for-quantization"),
        value("--moe-router-quantile-balancing-ema", float, 0.0),
        switch("--moe-routing-trace-capture-hidden-states"),
        switch("--moe-routing-trace-capture-logits"),
        switch("--moe-routing-trace-dump-weights"),
        value("--moe-routing-trace-max-training-iters", int, None),
        value("--moe-routing-trace-path", str, None),
        value("--moe-shared-expert-glu-interleave-size", int, None),
        switch("--moe-single-grouped-bias"),
        switch("--moe-single-grouped-weight"),
        value("--moe-upcycling-granularity", int, 1),
        switch("--moe-use-upcycling"),
        switch("--overlap-dispatch-backward-with-experts-wgrad"),
        switch("--overlap-moe-expert-parallel-comm"),
        value("--save-tokens-per-expert-interval", int, None),
        switch("--use-grouped-gemm-for-shared-expert"),
    ),
    not_supported="these mixture-of-experts options",
)


MLA = FlagTable(
    "mla",
    (
        switch("--cache-mla-latents"),
        value("--kv-lora-rank", int, 32),
        switch("--mla-down-proj-fusion"),
        value("--mscale", float, 1.0),
        value("--mscale-all-dim", float, 0.0),
        switch("--multi-latent-attention"),
        # Both set one dest; the first one added gives its default (None: the config decides).
        switch("--yarn-correction-range-round-to-int", default=None),
        off_switch("--no-yarn-correction-range-round-to-int", "yarn_correction_range_round_to_int"),
        value("--q-lora-rank", int, None),
        value("--qk-head-dim", int, 128),
        value("--qk-pos-emb-head-dim", int, 64),
        value("--rotary-scaling-factor", float, 1.0),
        value("--v-head-dim", int, 128),
        value("--yarn-beta-fast", float, None),
        value("--yarn-beta-slow", float, None),
        value("--yarn-original-max-position-embeddings", int, None),
    ),
    not_supported="multi-latent attention (MLA) and YaRN rotary scaling",
)


# "rope" is the rotary embedding every non-MLA model uses (Megatron-LM's launch scripts often spell it out); "yarn"
# needs MLA and is refused in argument_validation.
ROPE_TYPE = FlagTable(
    "mla",
    (
        value(
            "--rope-type",
            str,
            None,
            choices=["rope", "yarn"],
            help="Rotary embedding type: rope (what attention without MLA uses; the default) or yarn (MLA only, "
            "not supported yet here).",
        ),
    ),
)


EXPERIMENTAL_ATTENTION = FlagTable(
    "experimental attention variant",
    (
        value("--dsa-indexer-head-dim", int, None),
        value("--dsa-indexer-k-norm-epsilon", float, None),
        switch("--dsa-indexer-k-norm-fp32"),
        value("--dsa-indexer-loss-coeff", float, None),
        value("--dsa-indexer-n-heads", int, None),
        switch("--dsa-indexer-rope-interleaved"),
        value("--dsa-indexer-skip-topk-offset", int, 0),
        value("--dsa-indexer-topk", int, None),
        value("--dsa-indexer-topk-freq", int, 1),
        switch("--dsa-indexer-use-sparse-loss"),
        value("--dsa-kernel-backend", str, "none", choices=["none", "tilelang", "cudnn"]),
        value("--experimental-attention-variant", str, None, choices=["gated_delta_net", "dsa"]),
        value("--linear-attention-freq", "la_freq_type", None),
        value("--linear-conv-kernel-dim", int, 4),
        value("--linear-key-head-dim", int, 128),
        value("--linear-num-key-heads", int, 16),
        value("--linear-num-value-heads", int, 32),
        value("--linear-value-head-dim", int, 128),
        off_switch(
            "--no-dsa-indexer-rotate-activation, --disable-dsa-indexer-rotate-activation",
            "dsa_indexer_rotate_activation",
        ),
        off_switch("--no-dsa-indexer-scoring-relu, --disable-dsa-indexer-scoring-relu", "dsa_indexer_scoring_relu"),
        value("--no-weight-decay-cond-type", str, None, choices=["apply_wd_to_qk_layernorm"]),
    ),
    not_supported="experimental attention variants (gated delta net, DSA)",
)


ATTENTION_VARIANTS = FlagTable(
    "network size",
    (
        switch("--attention-output-gate"),
        value("--mrope-section", int, None, nargs="+"),
        value("--no-rope-freq", "no_rope_freq_type", None),
        switch("--qk-clip"),
        value("--qk-clip-alpha", float, 0.5),
        value("--qk-clip-threshold", float, 100),
        switch("--qk-l2-norm"),
        value("--softmax-type", str, "vanilla", choices=["vanilla", "off-by-one", "learnable"]),
        value("--window-attn-skip-freq", "moe_freq_type", None),
        value("--window-size", "tuple_type", None),
    ),
    not_supported="attention variant",
)


MAMBA = FlagTable(
    "mamba",
    (
        off_switch(
            "--disable-mamba-mem-eff-path",
            "use_mamba_mem_eff_path",
            help="Run the Mamba mixer unfused (the pure-PyTorch path is always taken without mamba-ssm).",
        ),
        value(
            "--hybrid-layer-pattern",
            str,
            None,
            help="One symbol per layer: M Mamba, * attention, - MLP, E MoE; '|' between pipeline "
            "stages. Sets the number of layers (--num-layers may be left out).",
        ),
        value("--hybrid-override-pattern", str, None, help="Deprecated: use --hybrid-layer-pattern."),
        value(
            "--hybrid-attention-ratio",
            float,
            0.0,
            help="Deprecated (use --hybrid-layer-pattern): the fraction of --num-layers that are attention layers.",
        ),
        value(
            "--hybrid-mlp-ratio",
            float,
            0.0,
            help="Deprecated (use --hybrid-layer-pattern): the fraction of --num-layers that are MLP layers.",
        ),
        switch("--is-hybrid-model", help="The model is a hybrid (set by --hybrid-layer-pattern too)."),
        value("--mamba-head-dim", int, 64, help="Mamba head size."),
        value("--mamba-num-groups", int, 8, help="Mamba B/C groups (split over tensor-parallel ranks)."),
        value("--mamba-num-heads", int, None, help="Mamba heads (default: 2 * hidden size / --mamba-head-dim)."),
        value("--mamba-state-dim", int, 128, help="Mamba state size."),
        value(
            "--mamba-training-ssm-states-dtype",
            str,
            None,
            choices=["fp32", "bf16"],
            help="Dtype of the SSM states passed between chunks in training (default: the activation dtype).",
        ),
    ),
)


MAMBA_INFERENCE = FlagTable(
    "mamba",
    (
        value("--mamba-inference-conv-states-dtype", str, "bf16", choices=["bf16", "fp16", "fp32"]),
        value("--mamba-inference-ssm-states-dtype", str, "bf16", choices=["bf16", "fp16", "fp32"]),
    ),
    no_effect="Mamba inference-state dtypes; training keeps no inference states",
)


MTP = FlagTable(
    "multi-token prediction",
    (
        switch("--mtp-detach-heads"),
        value("--mtp-hybrid-override-pattern", str, None),
        value("--mtp-loss-scaling-factor", float, 0.1),
        value("--mtp-num-layers", int, None),
        switch("--mtp-standalone"),
        switch("--mtp-use-repeated-layer"),
    ),
    not_supported="multi-token prediction (MTP)",
)


ENCODER_DECODER = FlagTable(
    "network size",
    (
        value("--decoder-num-layers", int, None),
        value("--decoder-seq-length", int, None),
        value("--relative-attention-max-distance", int, 128),
        value("--relative-attention-num-buckets", int, 32),
    ),
    not_supported="encoder-decoder models (T5)",
)


HETEROGENEOUS = FlagTable(
    "heterogeneous architecture",
    (
        value("--heterogeneous-layers-config-encoded-json", str, None),
        value("--heterogeneous-layers-config-path", str, None),
    ),
    not_supported="heterogeneous layer configurations",
)


MODEL_OPTIONS = FlagTable(
    "network size",
    (
        value("--activation-func-clamp-value", float, None),
        value("--embedding-init-method-std", float, None),
        value("--glu-linear-offset", float, 0.0),
        switch("--init-method-xavier-uniform"),
        off_switch(
            "--no-clone-scatter-output-in-embedding, --disable-clone-scatter-output-in-embedding",
            "clone_scatter_output_in_embedding",
        ),
        switch("--quick-geglu"),
    ),
    not_supported="model option",
)


MUP = FlagTable(
    "mup",
    (
        value("--mup-attn-scale-power", float, 1.0),
        value("--mup-base-head-dim", float, None),
        value("--mup-base-hidden-size", int, None),
        value("--mup-embedding-mult", float, 1.0),
        value("--mup-output-mult", float, 1.0),
        value("--mup-width-mult", float, 1.0),
        switch("--use-mup"),
    ),
    not_supported="muP (maximal update parametrization)",
)


VISION = FlagTable(
    "vision",
    (
        value("--classes-fraction", float, 1.0),
        value("--data-per-class-fraction", float, 1.0),
        value("--dino-bottleneck-size", int, 256),
        value("--dino-freeze-last-layer", float, 1),
        value("--dino-head-hidden-size", int, 2048),
        value("--dino-local-crops-number", int, 10),
        value("--dino-local-img-size", int, 96),
        switch("--dino-norm-last-layer"),
        value("--dino-teacher-temp", float, 0.07),
        value("--dino-warmup-teacher-temp", float, 0.04),
        value("--dino-warmup-teacher-temp-epochs", int, 30),
        value("--img-h", int, 224),
        value("--img-w", int, 224),
        value("--iter-per-epoch", int, 1250),
        value("--mask-factor", float, 1.0),
        value("--mask-prob", float, 0.15),
        value("--mask-type", str, "random", choices=["random", "row"]),
        value("--num-channels", int, 3),
        value("--num-classes", int, 1000),
        value("--patch-dim", int, 16),
        value("--swin-backbone-type", str, "tiny", choices=["tiny", "base", "h3"]),
        value("--vision-backbone-type", str, "vit", choices=["vit", "mit", "swin"]),
        switch("--vision-pretraining"),
        value("--vision-pretraining-type", str, "classify", choices=["classify", "inpaint", "dino"]),
    ),
    not_supported="vision models",
)


RETRIEVAL = FlagTable(
    "biencoder",
    (
        value("--bert-embedder-type", None, "megatron", choices=["megatron", "huggingface"]),
        value("--bert-load", str, None),
        off_switch("--bert-no-binary-head", "bert_binary_head"),
        value("--biencoder-projection-dim", int, 0),
        switch("--biencoder-shared-query-context-model"),
        value("--block-data-path", str, None),
        value("--embedding-path", str, None),
        value("--evidence-data-path", str, None),
        value("--ict-head-size", int, None),
        value("--ict-load", str, None),
        value("--indexer-batch-size", int, 128),
        value("--indexer-log-interval", int, 1000),
        switch("--output-bert-embeddings"),
        value("--query-in-block-prob", float, 0.1),
        value("--retriever-report-topk-accuracies", int, [], nargs="+"),
        switch("--retriever-score-scaling"),
        value("--short-seq-prob", float, 0.1),
        value("--titles-data-path", str, None),
        switch("--use-one-sent-docs"),
    ),
    not_supported="BERT / retrieval models (biencoder, ICT)",
)


KITCHEN = FlagTable(
    "kitchen",
    (
        value("--kitchen-attention-backend", str, "sdpa", choices=["sdpa", "fa"]),
        switch("--use-kitchen-attention"),
    ),
    not_supported="NVIDIA Kitchen quantization",
)


FP8_TRAINING = FlagTable(
    "mixed precision",
    (
        switch("--first-last-layers-bf16", help="Keep the first and last transformer layers out of FP8."),
        value(
            "--fp8-amax-compute-algo",
            str,
            "most_recent",
            choices=["most_recent", "max"],
            help="Delayed FP8 scaling: scale from the amax history's maximum or its most recent entry.",
        ),
        value("--fp8-amax-history-len", int, 1, help="Delayed FP8 scaling: amax values remembered per tensor."),
        value(
            "--fp8-format",
            str,
            None,
            dest="fp8",
            choices=["e4m3", "hybrid"],
            help="Run the transformer layers' linear GEMMs in FP8: e4m3 everywhere, or hybrid (E5M2 gradients). "
            "See docs/fp8.md.",
        ),
        value("--fp8-margin", int, 0, help="Delayed FP8 scaling: divide scales by 2**margin."),
        value(
            "--fp8-recipe",
            str,
            "delayed",
            choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"],
            help="FP8 scaling: per-tensor current (tensorwise) or from an amax history (delayed), E8M0 scales per "
            "32 elements (mxfp8), float32 scales per 1x128 / 128x128 tile (blockwise); custom is not supported yet.",
        ),
        off_switch(
            "--no-fp8-wgrad, --disable-fp8-wgrad",
            "fp8_wgrad",
            help="Compute weight gradients in the parameters' precision, not FP8.",
        ),
        value("--num-layers-at-end-in-bf16", int, 1, help="With --first-last-layers-bf16: trailing layers kept."),
        value("--num-layers-at-start-in-bf16", int, 1, help="With --first-last-layers-bf16: leading layers kept."),
    ),
)


FP8_NOT_BUILT = FlagTable(
    "mixed precision",
    (
        switch("--fp8-output-proj"),
        value("--fp8-quantizer-factory", str, None),
        switch("--reuse-grad-buf-for-mxfp8-param-ag"),
    ),
    not_supported="FP8 output layer, custom FP8 quantizers and MXFP8 parameter all-gather into the gradient buffer",
)


# Megatron's FP8 launch scripts pass it; the training still runs in FP8 (every GEMM quantises its weight), only the
# memory and all-gather savings of FP8 parameter storage are missing, so it warns rather than refuses.
FP8_PARAM_GATHER = FlagTable(
    "mixed precision",
    (switch("--fp8-param-gather"),),
    no_effect="FP8 parameter storage and its FP8 all-gather (parameters stay in their precision and each GEMM "
    "quantises the weight, so the numerics are FP8's)",
)


LOW_PRECISION_KNOBS = FlagTable(
    "mixed precision",
    (
        value("--fp4-format", str, None, dest="fp4", choices=["e2m1"]),
        switch("--fp4-param-gather"),
        value("--fp4-quantizer-factory", str, None),
        value("--fp4-recipe", str, "nvfp4", choices=["nvfp4", "custom"]),
        value("--fp8-interval", int, 1),
        switch("--keep-fp8-transpose-cache"),
        value("--te-precision-config-file", None, None),
    ),
    no_effect="FP4 recipes of Transformer Engine, its deprecated FP8 interval and FP8 parameter transpose caching; "
    "training runs in the --fp16/--bf16/fp32 precision (FP8 with --fp8-format)",
)


KERNEL_CHOICES = FlagTable(
    "training",
    (
        switch("--batch-invariant-mode"),
        value("--cross-entropy-fusion-impl", str, "native", choices=["native", "te"]),
        switch("--disable-bf16-reduced-precision-matmul"),
        switch("--disable-jit-fuser"),
        value("--flash-attention-version", int, None, choices=[2, 3, 4]),
        switch("--fused-residual-rmsnorm"),
        value("--onnx-safe", bool, None),
        switch("--te-rng-tracker"),
        switch("--use-flash-attn"),
        switch("--use-fused-weighted-squared-relu"),
        switch("--use-grouped-gemm-for-dense-mlp"),
        switch("--use-te-activation-func"),
        switch("--use-transformer-engine-op-fuser"),
    ),
    no_effect="GPU kernel selection; the PyTorch implementation runs",
)


TP_COMM_OVERLAP = FlagTable(
    "Transformer-Engine",
    (
        switch(
            "--tp-comm-overlap",
            help="Overlap the sequence-parallel all-gathers / reduce-scatters of the transformer layers' linears with "
            "their GEMMs, in sequence chunks with asynchronous collectives (needs --sequence-parallel).",
        ),
        value(
            "--tp-comm-overlap-cfg",
            str,
            None,
            help="Transformer Engine userbuffers YAML: accepted with a warning and not read (it tunes GPU kernels "
            "this build does not use).",
        ),
        off_switch(
            "--no-tp-comm-bulk-dgrad, --disable-tp-comm-bulk-dgrad",
            "tp_comm_bulk_dgrad",
            help="--tp-comm-overlap: wait for the input-gradient reduce-scatter before the weight-gradient GEMM.",
        ),
        off_switch(
            "--no-tp-comm-bulk-wgrad, --disable-tp-comm-bulk-wgrad",
            "tp_comm_bulk_wgrad",
            help="--tp-comm-overlap: wait for the input all-gather before the input-gradient GEMM.",
        ),
        off_switch(
            "--no-tp-comm-overlap-ag, --disable-tp-comm-overlap-ag",
            "tp_comm_overlap_ag",
            help="--tp-comm-overlap: do not pipeline the all-gathers with the GEMMs.",
        ),
        off_switch(
            "--no-tp-comm-overlap-rs, --disable-tp-comm-overlap-rs",
            "tp_comm_overlap_rs",
            help="--tp-comm-overlap: do not pipeline the reduce-scatters with the GEMMs.",
        ),
        switch(
            "--tp-comm-overlap-rs-dgrad",
            help="--tp-comm-overlap: pipeline the column-parallel input-gradient reduce-scatter with its GEMM.",
        ),
    ),
)


TE_COMM_OVERLAP = FlagTable(
    "Transformer-Engine",
    (
        switch("--disable-symmetric-registration"),
        off_switch("--no-tp-comm-split-ag, --disable-tp-comm-split-ag", "tp_comm_split_ag"),
        off_switch("--no-tp-comm-split-rs, --disable-tp-comm-split-rs", "tp_comm_split_rs"),
        value("--symmetric-ar-type", str, None, choices=["two_shot", "one_shot", "multimem_all_reduce"]),
        value("--tp-comm-bootstrap-backend", str, "nccl", choices=["nccl", "mpi", "gloo"]),
        switch("--use-nccl-ub", dest="nccl_ub"),
    ),
    no_effect="Transformer Engine userbuffers and symmetric-memory communication",
)


CUDA_GRAPHS = FlagTable(
    "training",
    (
        value("--cuda-graph-impl", str, "none", choices=["none", "local", "transformer_engine", "full_iteration"]),
        value("--cuda-graph-modules", "_parse_cuda_graph_modules_arg", [], nargs="+"),
        value(
            "--cuda-graph-scope", "_parse_cuda_graph_modules_arg", None, dest="cuda_graph_scope_deprecated", nargs="+"
        ),
        value("--cuda-graph-warmup-steps", int, 3),
        switch("--delay-offload-until-cuda-graph"),
        switch("--enable-cuda-graph"),
        switch("--external-cuda-graph"),
        switch("--optimizer-cuda-graph"),
    ),
    no_effect="CUDA graphs",
)


TABLES = (
    MOE,
    MLA,
    ROPE_TYPE,
    EXPERIMENTAL_ATTENTION,
    ATTENTION_VARIANTS,
    MAMBA,
    MAMBA_INFERENCE,
    MTP,
    ENCODER_DECODER,
    HETEROGENEOUS,
    MODEL_OPTIONS,
    MUP,
    VISION,
    RETRIEVAL,
    KITCHEN,
    FP8_TRAINING,
    FP8_NOT_BUILT,
    FP8_PARAM_GATHER,
    LOW_PRECISION_KNOBS,
    KERNEL_CHOICES,
    TP_COMM_OVERLAP,
    TE_COMM_OVERLAP,
    CUDA_GRAPHS,
)
