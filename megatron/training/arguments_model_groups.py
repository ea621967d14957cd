"""Megatron-LM's hand-written argument groups that describe the model: network size, regularization,
initialization, mixed precision, tokenizer, MoE, Transformer Engine and experimental flags. A flag that is the
mechanical image of a config dataclass field is generated from it (``add_field_argument``). ``arguments`` adds the
groups in Megatron-LM's order.
"""

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer_param_scheduler import WD_INCR_STYLES
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.argument_utils import add_field_argument
from megatron.training.flag_tables import (
    POSITION_EMBEDDING_TYPES,
    TOKENIZER_TYPES,
    moe_freq_type,
)


def add_network_size_args(parser):
    group = parser.add_argument_group(title="network size")
    add_field_argument(group, TransformerConfig, "num_layers", default=None)
    add_field_argument(group, TransformerConfig, "hidden_size", default=None)
    add_field_argument(
        group,
        TransformerConfig,
        "ffn_hidden_size",
        help_suffix=" With --swiglu: 2/3 of that, rounded down to a multiple of 64.",
    )
    add_field_argument(group, TransformerConfig, "num_attention_heads", default=None)
    add_field_argument(group, TransformerConfig, "attention_backend", choices=list(AttnBackend))
    add_field_argument(group, TransformerConfig, "kv_channels")
    group.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention with --num-query-groups key/value heads.",
    )
    add_field_argument(
        group,
        TransformerConfig,
        "num_query_groups",
        default=1,
        help="Key/value heads for grouped-query attention (read only with --group-query-attention).",
    )
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Size of the learned position-embedding table (the longest sequence it supports). "
        "Defaults to --seq-length for rope and none.",
    )
    group.add_argument(
        "--position-embedding-type",
        type=str,
        default="learned_absolute",
        choices=POSITION_EMBEDDING_TYPES,
        help="Position embedding type.",
    )
    group.add_argument("--rotary-base", type=int, default=10000, help="Base of the rotary embedding frequencies.")
    group.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of each head's dimensions that get rotary embeddings.",
    )
    add_field_argument(group, TransformerConfig, "rotary_interleaved")
    group.add_argument(
        "--rotary-seq-len-interpolation-factor",
        type=int,
        default=None,
        help="Divide rotary positions by this factor (position interpolation for longer sequences).",
    )
    group.add_argument("--use-rope-scaling", action="store_true", help="Scale rotary frequencies as Llama 3.x does.")
    group.add_argument(
        "--rope-scaling-factor",
        type=float,
        default=8.0,
        help="Llama 3.x rope scaling factor (with --use-rope-scaling).",
    )
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this value times the tensor-parallel size.",
    )
    add_field_argument(group, TransformerConfig, "normalization", choices=["LayerNorm", "RMSNorm"])
    add_field_argument(group, TransformerConfig, "layernorm_epsilon", flags=["--norm-epsilon"])
    add_field_argument(group, TransformerConfig, "layernorm_zero_centered_gamma", flags=["--apply-layernorm-1p"])
    add_field_argument(group, TransformerConfig, "apply_residual_connection_post_layernorm")
    group.add_argument("--squared-relu", action="store_true", help="Use squared ReLU instead of GELU in the MLP.")
    group.add_argument("--swiglu", action="store_true", help="Use a gated MLP with SiLU (SwiGLU) instead of GELU.")
    group.add_argument(
        "--openai-gelu",
        action="store_true",
        help="Use the tanh approximation of GELU (OpenAI's GPT-2 formula) in the MLP.",
    )
    group.add_argument(
        "--encoder-num-layers", type=int, default=None, help="Another name for --num-layers (give one of them)."
    )
    group.add_argument(
        "--no-position-embedding",
        action="store_false",
        dest="add_position_embedding",
        help="Deprecated: use --position-embedding-type. Accepted with rope (which adds no position "
        "embedding table); refused otherwise.",
    )
    group.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Deprecated: same as --position-embedding-type rope.",
    )
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Give the output layer its own weights instead of sharing the input embedding's.",
    )
    add_field_argument(group, TransformerConfig, "qk_layernorm")
    return parser


def add_regularization_args(parser):
    group = parser.add_argument_group(title="regularization")
    add_field_argument(group, TransformerConfig, "attention_dropout")
    add_field_argument(group, TransformerConfig, "hidden_dropout")
    add_field_argument(group, OptimizerConfig, "weight_decay")
    group.add_argument(
        "--start-weight-decay",
        type=float,
        help="Weight decay at the start of training (with a non-constant --weight-decay-incr-style).",
    )
    group.add_argument(
        "--end-weight-decay",
        type=float,
        help="Weight decay at the end of training (with a non-constant --weight-decay-incr-style).",
    )
    group.add_argument(
        "--weight-decay-incr-style",
        type=str,
        default="constant",
        choices=WD_INCR_STYLES,
        help="How weight decay moves from --start-weight-decay to --end-weight-decay.",
    )
    for name in ("clip_grad", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "apply_wd_to_qk_layernorm"):
        add_field_argument(group, OptimizerConfig, name)
    return parser


def add_initialization_args(parser):
    group = parser.add_argument_group(title="initialization")
    group.add_argument("--seed", type=int, default=1234, help="Random seed for python, numpy and torch.")
    group.add_argument(
        "--data-parallel-random-init",
        action="store_true",
        help="Initialise the weights differently on each data-parallel rank.",
    )
    add_field_argument(group, TransformerConfig, "init_method_std")
    add_field_argument(group, ModelParallelConfig, "perform_initialization", flags=["--no-initialization"])
    return parser


def add_mixed_precision_args(parser):
    group = parser.add_argument_group(title="mixed precision")
    add_field_argument(group, ModelParallelConfig, "fp16")
    add_field_argument(group, ModelParallelConfig, "bf16")
    group.add_argument("--grad-reduce-in-bf16", action="store_true", help="Reduce gradients in bfloat16.")
    for name in ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
        add_field_argument(group, OptimizerConfig, name)
    add_field_argument(group, TransformerConfig, "fp32_residual_connection")
    add_field_argument(group, TransformerConfig, "apply_query_key_layer_scaling")
    add_field_argument(group, TransformerConfig, "attention_softmax_in_fp32", default=False)
    group.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Accumulate and all-reduce gradients in fp32 (always on with --bf16 unless --grad-reduce-in-bf16).",
    )
    group.add_argument(
        "--fp16-lm-cross-entropy",
        action="store_true",
        help="Compute the output-layer cross entropy in fp16 (with --fp16).",
    )
    return parser


def add_tokenizer_args(parser):
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="Vocabulary size (NullTokenizer; TikTokenizer's cap), before padding.",
    )
    group.add_argument("--vocab-file", type=str, default=None, help="Vocabulary file (GPT2BPETokenizer's vocab.json).")
    group.add_argument("--merge-file", type=str, default=None, help="BPE merge file (GPT2BPETokenizer's merges.txt).")
    group.add_argument(
        "--vocab-extra-ids", type=int, default=0, help="Extra sentinel tokens added to a SentencePiece vocabulary."
    )
    group.add_argument(
        "--tokenizer-type",
        type=str,
        default=None,
        choices=TOKENIZER_TYPES,
        help="Tokenizer to build (Megatron-LM's choices; the BERT, multimodal and SFT ones are not supported yet).",
    )
    group.add_argument(
        "--tokenizer-model",
        type=str,
        default=None,
        help="Tokenizer model file or directory (SentencePiece, Hugging Face, tiktoken).",
    )
    group.add_argument(
        "--tiktoken-pattern", type=str, default=None, choices=["v1", "v2"], help="TikTokenizer pattern: v1 or v2."
    )
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="Special tokens reserved at the start of a TikTokenizer vocabulary.",
    )
    group.add_argument(
        "--tiktoken-special-tokens",
        type=str,
        nargs="+",
        default=None,
        help="TikTokenizer special tokens (must include <unk>, <s> and </s>).",
    )
    return parser


# MoE flags generated from TransformerConfig fields of the same name: (field, extra add_argument keywords). Where
# the field's type has no mechanical command-line form (int-or-list, str-or-list), Megatron-LM's type and nargs.
_MOE_FIELD_FLAGS = (
    ("moe_ffn_hidden_size", {}),
    ("moe_layer_freq", {"type": moe_freq_type}),
    ("moe_router_topk", {}),
    (
        "moe_router_load_balancing_type",
        {
            "type": str,
            "nargs": "+",
            "choices": ["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"],
        },
    ),
    ("moe_aux_loss_coeff", {"type": float, "nargs": "+"}),
    ("moe_z_loss_coeff", {}),
    ("moe_router_score_function", {"choices": ["softmax", "sigmoid", "sqrtsoftplus"]}),
    ("moe_router_pre_softmax", {}),
    ("moe_router_topk_scaling_factor", {}),
    ("moe_router_num_groups", {}),
    ("moe_router_group_topk", {}),
    ("moe_router_enable_expert_bias", {}),
    ("moe_router_bias_update_rate", {}),
    ("moe_router_dtype", {"choices": ["fp32", "fp64"]}),
    ("moe_input_jitter_eps", {}),
    ("moe_expert_capacity_factor", {}),
    ("moe_pad_expert_input_to_capacity", {}),
    ("moe_token_drop_policy", {"choices": ["probs", "position"]}),
    ("moe_token_dispatcher_type", {"choices": ["allgather", "alltoall", "flex"]}),
    ("moe_grouped_gemm", {}),
    ("moe_shared_expert_intermediate_size", {}),
    ("moe_shared_expert_gate", {}),
    ("moe_shared_expert_overlap", {}),
    ("moe_layer_recompute", {}),
    ("moe_permute_fusion", {}),
    ("moe_router_fusion", {}),
    ("moe_per_layer_logging", {}),
    ("moe_apply_probs_on_input", {}),
    ("moe_router_force_load_balancing", {}),
)


def add_moe_args(parser):
    group = parser.add_argument_group(title="moe")
    add_field_argument(group, ModelParallelConfig, "expert_model_parallel_size")
    add_field_argument(group, ModelParallelConfig, "expert_tensor_parallel_size")
    add_field_argument(group, TransformerConfig, "num_moe_experts", flags=["--num-experts"], dest="num_experts")
    for name, kwargs in _MOE_FIELD_FLAGS:
        add_field_argument(group, TransformerConfig, name, **kwargs)
    return parser


def add_transformer_engine_args(parser):
    group = parser.add_argument_group(title="Transformer-Engine")
    group.add_argument(
        "--transformer-impl",
        type=str,
        default="local",
        choices=["local", "transformer_engine", "inference_optimized"],
        help="Transformer implementation: local (pure PyTorch) or transformer_engine (the same PyTorch "
        "modules in NVIDIA Transformer Engine's checkpoint layout, so Megatron-LM's Transformer Engine "
        "checkpoints load as they are; said once). Megatron-LM's default is transformer_engine; this "
        "project's is local.",
    )
    return parser


def add_experimental_args(parser):
    group = parser.add_argument_group(title="experimental")
    group.add_argument(
        "--spec",
        type=str,
        default=None,
        nargs="*",
        help="<module function> returning the layer spec to build the model with ('local' for the local spec).",
    )
    group.add_argument(
        "--yaml-cfg",
        type=str,
        default=None,
        help="YAML file of settings (flat keys named like the arguments, plus Megatron-LM's "
        "model_parallel: and language_model: sections); flags on the command line override it.",
    )
    return parser
