"""Megatron-LM's command line: ``parse_args`` and ``validate_args``, with Megatron-LM's flag names and defaults.

Flags are organised in Megatron-LM's groups (``_add_network_size_args``, ``_add_training_args``, ...). A flag that
is the mechanical image of a config dataclass field is generated from that field (``add_field_argument``: name,
type, default and help come from the dataclass); the rest are written here. Every other Megatron-LM flag comes from
the tables of ``arguments_model_flags``, ``arguments_run_flags`` and ``arguments_service_flags`` (see
``arguments_support``): it parses with Megatron-LM's dest, default, type and choices, and ``validate_args`` refuses
it when set ("not supported yet: <feature> (--flag)") or, for a GPU-kernel or vendor-service knob, ignores it with
one warning. ``validate_args`` derives the values Megatron-LM derives (data-parallel size, global batch size, FFN
size, ...) and turns every inconsistent setting into one ``ValueError`` that names the flags and the fix, before
any process group exists. An unknown flag exits (status 2) with one line naming the closest known flag.

Where this project differs from Megatron-LM, the flag's help says so: ``--transformer-impl`` defaults to ``local``
(Transformer Engine is optional here), and GPU-only switches (fused kernels, ``--distributed-backend nccl`` without
a GPU, Transformer Engine when it is not installed) are accepted and turned off with one warning when they cannot
apply on this machine.
"""

import argparse
import ast
import difflib
import os
import signal
import sys
from typing import List

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer_param_scheduler import LR_DECAY_STYLES, WD_INCR_STYLES
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import argument_validation
from megatron.training.argument_utils import (
    add_field_argument,
    core_ddp_config_from_args,
    core_gpt_dataset_config_from_args,
    core_optimizer_config_from_args,
    core_transformer_config_from_args,
    enum_by_name,
    get_blend_and_blend_per_split,
)
from megatron.training.arguments_model_flags import HETEROGENEOUS
from megatron.training.arguments_model_flags import TABLES as MODEL_FLAG_TABLES
from megatron.training.arguments_run_flags import TABLES as RUN_FLAG_TABLES
from megatron.training.arguments_service_flags import TABLES as SERVICE_FLAG_TABLES
from megatron.training.arguments_support import add_flag_tables, argument_group, refuse_features_not_built
from megatron.training.yaml_arguments import yaml_settings

__all__ = [
    "parse_args",
    "parse_args_list",
    "parse_and_validate_args",
    "build_parser",
    "add_megatron_arguments",
    "validate_args",
    "validate_model_config_args_from_heterogeneous_config",
    "moe_freq_type",
    "la_freq_type",
    "no_rope_freq_type",
    "tuple_type",
    # The config builders, importable from here as in Megatron-LM.
    "core_transformer_config_from_args",
    "core_ddp_config_from_args",
    "core_optimizer_config_from_args",
    "core_gpt_dataset_config_from_args",
    "get_blend_and_blend_per_split",
]

# Megatron-LM's choices; the values not built yet are refused by validate_args (argument_validation).
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "mrope", "relative", "none")
OPTIMIZERS = ("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon")
TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
)
CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
FLAG_TABLES = MODEL_FLAG_TABLES + RUN_FLAG_TABLES + SERVICE_FLAG_TABLES
"""Every Megatron-LM flag this project does not implement, with what setting it does here (arguments_support)."""


def _layer_pattern(text: str, flag_kind: str):
    """An int N (every N-th layer) or a per-layer list written as a Python expression of int lists, ``*`` and
    ``+`` (``"([1]*3+[0])*2"``), evaluated without ``eval``."""

    def evaluate(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return [evaluate(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left * right if isinstance(node.op, ast.Mult) else left + right
        raise ValueError(node)

    try:
        result = evaluate(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {flag_kind} pattern: give an integer or a list expression such as '([1]*3+[0])*2'"
        ) from None
    if not isinstance(result, (int, list)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a {flag_kind} pattern")
    return result


def moe_freq_type(x):
    """``--moe-layer-freq``: every N-th layer is an MoE layer (int), or one 0/1 per layer (list expression)."""
    return _layer_pattern(x, "layer frequency")


def la_freq_type(x):
    """``--linear-attention-freq``: every N-th layer uses linear attention (int), or one 0/1 per layer (list)."""
    return _layer_pattern(x, "linear-attention frequency")


def no_rope_freq_type(x):
    """``--no-rope-freq``: every N-th layer has no rotary embedding (int), or one 0/1 per layer (list)."""
    return _layer_pattern(x, "no-rope frequency")


def tuple_type(x):
    """``--window-size``: ``"(left, right)"`` or ``"left,right"`` -> a tuple of ints (-1: unbounded)."""
    try:
        parts = [int(part) for part in str(x).strip().strip("()").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{x!r} is not a tuple of integers such as '(128, 0)'") from None
    return tuple(parts)


def _parse_cuda_graph_modules_arg(x):
    """``--cuda-graph-modules``: one module name (CUDA graphs have no effect here, so any name is accepted)."""
    return str(x)


NAMED_TYPES = {
    function.__name__: function
    for function in (moe_freq_type, la_freq_type, no_rope_freq_type, tuple_type, _parse_cuda_graph_modules_arg)
}


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add all of Megatron-LM's arguments to ``parser``: the ones this project implements, in Megatron-LM's
    groups, then the tables of the ones it does not (accepted, refused or ignored when set: see arguments_support)."""
    parser = _add_network_size_args(parser)
    parser = _add_regularization_args(parser)
    parser = _add_training_args(parser)
    parser = _add_initialization_args(parser)
    parser = _add_learning_rate_args(parser)
    parser = _add_checkpointing_args(parser)
    parser = _add_mixed_precision_args(parser)
    parser = _add_distributed_args(parser)
    parser = _add_validation_args(parser)
    parser = _add_data_args(parser)
    parser = _add_tokenizer_args(parser)
    parser = _add_moe_args(parser)
    parser = _add_logging_args(parser)
    parser = _add_transformer_engine_args(parser)
    parser = _add_experimental_args(parser)
    parser = _add_deprecated_args(parser)
    return add_flag_tables(parser, FLAG_TABLES, NAMED_TYPES)


class MegatronArgumentParser(argparse.ArgumentParser):
    """argparse with short errors: an unknown flag gets one line with the closest known flag, and no error prints
    the usage (with 800 flags it would bury the message); ``--help`` still lists every flag. Under torchrun only
    rank 0 prints (every rank exits with status 2), so a job shows the message once."""

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self._exit_on_unknown(unknown)
        return parsed

    def _exit_on_unknown(self, unknown: List[str]) -> None:
        known = [option for action in self._actions for option in action.option_strings]
        lines = []
        for item in unknown:
            if not item.startswith("-"):
                continue  # the value of the unknown flag before it
            flag = item.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1)
            lines.append(f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else ""))
        if not lines:
            lines = [f"unexpected argument(s): {' '.join(unknown)}"]
        self._exit_once("\n".join(lines))

    def error(self, message):
        self._exit_once(f"{self.prog}: error: {message} (--help lists every flag)")

    def _exit_once(self, message: str) -> None:
        self.exit(2, message + "\n" if int(os.getenv("RANK", "0")) == 0 else None)


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    """The argument parser ``parse_args`` uses, with ``extra_args_provider(parser)`` applied when given."""
    parser = MegatronArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """Parse the command line (``sys.argv[1:]``) into Megatron-LM's argument namespace (see ``parse_args_list``)."""
    return parse_args_list(sys.argv[1:], extra_args_provider, ignore_unknown_args)


def parse_args_list(argv: List[str], extra_args_provider=None, ignore_unknown_args=False):
    """``parse_args`` of the argument list ``argv`` instead of ``sys.argv[1:]``.

    With ``--yaml-cfg FILE`` the file's settings replace the defaults and flags given on the command line still win.
    ``rank`` and ``world_size`` come from torchrun's ``RANK`` and ``WORLD_SIZE`` (0 and 1 without them). The result
    still has to go through ``validate_args``. An unknown flag exits with status 2 and one line naming the closest
    known flag (unless ``ignore_unknown_args``).
    """
    parser = build_parser(extra_args_provider)
    argv = list(argv)

    def parse():
        if ignore_unknown_args:
            return parser.parse_known_args(argv)[0]
        return parser.parse_args(argv)

    args = parse()
    if args.yaml_cfg is not None:
        parser.set_defaults(**yaml_settings(args.yaml_cfg, parser))
        args = parse()
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args


def validate_args(args, defaults={}):
    """Megatron-LM's ``validate_args``: refuse flags for features not built yet, ignore (with a warning) flags that
    have no effect here, check every setting and fill in the derived values. See ``argument_validation``."""
    return argument_validation.validate_args(args, defaults)


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
    """``parse_args``, then (with ``--use-checkpoint-args``) the model arguments from the checkpoint, then
    ``validate_args``; the result becomes the run's arguments (``get_args()``), which ``initialize_megatron``
    starts from."""
    from megatron.training.checkpoint_args import load_args_from_checkpoint
    from megatron.training.global_vars import set_args

    args = parse_args(extra_args_provider, ignore_unknown_args)
    if args.use_checkpoint_args or args_defaults.get("use_checkpoint_args", False):
        load_args_from_checkpoint(args)
    validate_args(args, args_defaults)
    set_args(args)
    return args


def validate_model_config_args_from_heterogeneous_config(args):
    """Megatron-LM's check of the arguments against a heterogeneous layer config (``--heterogeneous-layers-config-
    path`` / ``-encoded-json``). Such configs are not supported yet: a run that names one is refused, with the
    message validate_args gives."""
    refuse_features_not_built(args, (HETEROGENEOUS,), {})
    return args


def _add_network_size_args(parser):
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


def _add_regularization_args(parser):
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


def _add_training_args(parser):
    group = parser.add_argument_group(title="training")
    group.add_argument(
        "--micro-batch-size", type=int, default=None, help="Samples per micro-batch on each model replica."
    )
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step over all data-parallel ranks; a multiple of "
        "--micro-batch-size times the data-parallel size (default: exactly that product).",
    )
    group.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        help="Ramp the global batch size up: <start batch size> <increment> <ramp-up samples>, "
        "e.g. '16 8 300000' with --global-batch-size 1024.",
    )
    group.add_argument(
        "--step-batch-size-schedule",
        type=str,
        default=None,
        help="Global batch size by stages instead of --rampup-batch-size: 'threshold:size' pairs, "
        "each threshold counted in consumed tokens (K/M/B suffixes allowed), the first 0 (e.g. "
        "'0:768 250B:1536').",
    )
    group.add_argument(
        "--decrease-batch-size-if-needed",
        action="store_true",
        help="Round the global batch size down to a multiple of micro-batch size x data-parallel "
        "size instead of failing.",
    )
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Recompute activations in the backward pass (same as --recompute-granularity selective).",
    )
    add_field_argument(group, TransformerConfig, "recompute_granularity", choices=["full", "selective"])
    add_field_argument(group, TransformerConfig, "recompute_method", choices=["uniform", "block"])
    add_field_argument(group, TransformerConfig, "recompute_num_layers")
    add_field_argument(group, TransformerConfig, "recompute_modules", nargs="+")
    add_field_argument(group, TransformerConfig, "distribute_saved_activations", default=False)
    group.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="Do not check the loss and the gradients for NaN/Inf at each step.",
    )
    group.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="Iterations to train for, over all runs (or give --train-samples).",
    )
    group.add_argument(
        "--train-samples", type=int, default=None, help="Samples to train on, over all runs (or give --train-iters)."
    )
    group.add_argument("--log-interval", type=int, default=100, help="Iterations between two training log lines.")
    group.add_argument(
        "--exit-interval", type=int, default=None, help="Exit once the iteration number is a multiple of this."
    )
    group.add_argument(
        "--exit-duration-in-mins",
        type=int,
        default=None,
        help="Exit (after saving, with --save) once training has run this many minutes.",
    )
    group.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On the --exit-signal (SIGTERM), save a checkpoint and exit cleanly.",
    )
    group.add_argument(
        "--exit-signal",
        type=enum_by_name(signal.Signals),
        default=signal.SIGTERM,
        choices=list(signal.Signals),
        help="The signal --exit-signal-handler catches, by name.",
    )
    group.add_argument("--tensorboard-dir", type=str, default=None, help="Write TensorBoard logs to this directory.")
    add_field_argument(group, TransformerConfig, "masked_softmax_fusion", default=True)
    group.add_argument(
        "--no-bias-gelu-fusion",
        action="store_false",
        dest="bias_gelu_fusion",
        help="Do not fuse the MLP bias add and GELU.",
    )
    group.add_argument(
        "--no-bias-swiglu-fusion",
        action="store_false",
        dest="bias_swiglu_fusion",
        help="Do not fuse the MLP bias add and SwiGLU.",
    )
    add_field_argument(group, TransformerConfig, "bias_dropout_fusion", default=True)
    add_field_argument(group, TransformerConfig, "apply_rope_fusion", flags=["--no-rope-fusion"], default=True)
    add_field_argument(group, ModelParallelConfig, "cross_entropy_loss_fusion")
    group.add_argument(
        "--no-persist-layer-norm", action="store_true", help="Do not use apex's persistent layer-norm kernel."
    )
    add_field_argument(group, TransformerConfig, "add_bias_linear", flags=["--disable-bias-linear"])
    add_field_argument(group, TransformerConfig, "add_qkv_bias")
    add_field_argument(
        group,
        OptimizerConfig,
        "optimizer",
        choices=OPTIMIZERS,
        help_suffix=" (adam and sgd here; the others are not supported yet).",
    )
    group.add_argument(
        "--dataloader-type",
        type=str,
        default=None,
        choices=["single", "cyclic", "external"],
        help="single: one pass in order; cyclic: reshuffled every epoch; external: the dataset "
        "provider returns iterators (default: single).",
    )
    add_field_argument(group, ModelParallelConfig, "sequence_parallel")
    add_field_argument(
        group,
        ModelParallelConfig,
        "gradient_accumulation_fusion",
        flags=["--no-gradient-accumulation-fusion"],
        default=True,
    )
    group.add_argument(
        "--use-mcore-models",
        action="store_true",
        dest="deprecated_use_mcore_models",
        help="Deprecated and ignored: Megatron-Core models are the only models.",
    )
    group.add_argument(
        "--manual-gc",
        action="store_true",
        help="Disable Python's automatic garbage collection; collect at --manual-gc-interval and "
        "around evaluation instead, at the same time on every rank.",
    )
    group.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="Iterations between manual garbage collections (0: only around evaluation).",
    )
    group.add_argument(
        "--no-manual-gc-eval",
        "--disable-manual-gc-eval",
        action="store_false",
        dest="manual_gc_eval",
        help="With --manual-gc, do not collect around evaluation.",
    )
    add_field_argument(group, ModelParallelConfig, "use_cpu_initialization", default=None)
    group.add_argument(
        "--empty-unused-memory-level",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="Release cached accelerator memory each iteration: 0 off, 1 moderate, 2 aggressive.",
    )
    add_field_argument(group, ModelParallelConfig, "deterministic_mode")
    add_field_argument(group, TransformerConfig, "calculate_per_token_loss")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Print which global ranks form each TP/PP/DP/CP/EP group, the layers and parameters of "
        "each pipeline stage and the theoretical memory, then exit without training.",
    )
    return parser


def _add_initialization_args(parser):
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


def _add_learning_rate_args(parser):
    group = parser.add_argument_group(title="learning rate")
    add_field_argument(group, OptimizerConfig, "lr")
    group.add_argument(
        "--lr-decay-style",
        type=str,
        default="linear",
        choices=LR_DECAY_STYLES,
        help="Learning-rate decay after warm-up.",
    )
    group.add_argument(
        "--lr-wsd-decay-style",
        type=str,
        default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="Decay of the annealing phase of the WSD schedule.",
    )
    group.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Iterations to decay the learning rate over (default: --train-iters).",
    )
    group.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="Samples to decay the learning rate over (default: --train-samples).",
    )
    group.add_argument(
        "--lr-wsd-decay-samples", type=int, default=None, help="Samples in the annealing phase of the WSD schedule."
    )
    group.add_argument(
        "--lr-wsd-decay-iters", type=int, default=None, help="Iterations in the annealing phase of the WSD schedule."
    )
    group.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Fraction of the decay iterations/samples spent warming up (instead of "
        "--lr-warmup-iters/--lr-warmup-samples).",
    )
    group.add_argument("--lr-warmup-iters", type=int, default=0, help="Iterations of linear learning-rate warm-up.")
    group.add_argument("--lr-warmup-samples", type=int, default=0, help="Samples of linear learning-rate warm-up.")
    group.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate warm-up starts from.")
    add_field_argument(group, OptimizerConfig, "min_lr", default=0.0)
    group.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="Take the schedule (lr, warm-up, min lr, decay length and style) from these flags, "
        "ignoring the checkpoint's.",
    )
    group.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="Take the schedule from the checkpoint, ignoring these flags.",
    )
    add_field_argument(group, OptimizerConfig, "decoupled_lr")
    add_field_argument(group, OptimizerConfig, "decoupled_min_lr")
    return parser


def _add_checkpointing_args(parser):
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    group.add_argument(
        "--save-interval",
        "--persistent-save-interval",
        type=int,
        default=None,
        help="Iterations between two checkpoint saves.",
    )
    group.add_argument("--no-save-optim", action="store_true", default=None, help="Do not save the optimizer state.")
    group.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save the RNG state.")
    group.add_argument("--load", type=str, default=None, help="Directory to load a checkpoint from.")
    group.add_argument(
        "--no-load-optim",
        action="store_true",
        default=None,
        help="Do not load the optimizer state from the checkpoint.",
    )
    group.add_argument(
        "--no-load-rng", action="store_true", default=None, help="Do not load the RNG state from the checkpoint."
    )
    group.add_argument(
        "--finetune",
        action="store_true",
        help="Load only the model weights and start at iteration 0 (no optimizer or RNG state).",
    )
    group.add_argument(
        "--pretrained-checkpoint",
        type=str,
        default=None,
        help="Directory of a pretrained checkpoint to finetune from (when --load has none).",
    )
    group.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="Take the model arguments from the checkpoint given by --load.",
    )
    group.add_argument(
        "--use-mp-args-from-checkpoint-args",
        action="store_true",
        help="With --use-checkpoint-args, take the model-parallel layout (TP, PP, virtual stages) "
        "from the checkpoint too; without it this command line's layout is used and the checkpoint "
        "is resharded on load.",
    )
    group.add_argument(
        "--no-use-tokenizer-model-from-checkpoint-args",
        "--disable-use-tokenizer-model-from-checkpoint-args",
        action="store_false",
        dest="use_tokenizer_model_from_checkpoint_args",
        help="With --use-checkpoint-args, keep this command line's --tokenizer-model. (This project's "
        "--use-checkpoint-args never takes the tokenizer model path from the checkpoint.)",
    )
    group.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="With --load, exit when no checkpoint is found instead of starting from scratch.",
    )
    group.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="Load the checkpoint of this iteration instead of the one the tracker file names.",
    )
    group.add_argument(
        "--ckpt-format",
        type=str,
        default="torch_dist",
        choices=CKPT_FORMATS,
        help="Checkpoint format; this project reads and writes torch_dist.",
    )
    group.add_argument(
        "--async-save", action="store_true", help="Write checkpoints in the background (torch_dist only)."
    )
    group.add_argument(
        "--ckpt-fully-parallel-save",
        action="store_true",
        dest="ckpt_fully_parallel_save_deprecated",
        help="Deprecated and ignored: fully parallel save is the default (see --no-ckpt-fully-parallel-save).",
    )
    group.add_argument(
        "--no-ckpt-fully-parallel-save",
        action="store_false",
        dest="ckpt_fully_parallel_save",
        help="Do not spread the checkpoint writes over the data-parallel ranks.",
    )
    group.add_argument(
        "--ckpt-fully-parallel-load",
        action="store_true",
        help="Spread the checkpoint reads over the data-parallel ranks.",
    )
    return parser


def _add_mixed_precision_args(parser):
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


def _add_distributed_args(parser):
    group = parser.add_argument_group(title="distributed")
    add_field_argument(group, ModelParallelConfig, "tensor_model_parallel_size")
    add_field_argument(group, ModelParallelConfig, "pipeline_model_parallel_size")
    add_field_argument(
        group,
        TransformerConfig,
        "num_layers_in_first_pipeline_stage",
        flags=["--decoder-first-pipeline-num-layers"],
        dest="decoder_first_pipeline_num_layers",
    )
    add_field_argument(
        group,
        TransformerConfig,
        "num_layers_in_last_pipeline_stage",
        flags=["--decoder-last-pipeline-num-layers"],
        dest="decoder_last_pipeline_num_layers",
    )
    group.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per model chunk of the interleaved schedule (sets the virtual pipeline size).",
    )
    group.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="Model chunks per pipeline rank for the interleaved schedule.",
    )
    add_field_argument(
        group,
        ModelParallelConfig,
        "microbatch_group_size_per_vp_stage",
        flags=["--microbatch-group-size-per-virtual-pipeline-stage"],
    )
    add_field_argument(
        group, ModelParallelConfig, "overlap_p2p_comm", flags=["--no-overlap-p2p-communication"], default=True
    )
    add_field_argument(
        group, ModelParallelConfig, "overlap_p2p_comm_warmup_flush", flags=["--overlap-p2p-communication-warmup-flush"]
    )
    group.add_argument(
        "--distributed-backend",
        type=str,
        default="nccl",
        choices=["nccl", "gloo"],
        help="torch.distributed backend; nccl needs GPUs and falls back to gloo (with a warning) "
        "on a machine without CUDA.",
    )
    group.add_argument(
        "--distributed-timeout-minutes",
        type=int,
        default=10,
        help="Timeout of torch.distributed collectives, in minutes.",
    )
    add_field_argument(group, DistributedDataParallelConfig, "overlap_grad_reduce")
    group.add_argument(
        "--no-align-grad-reduce",
        "--disable-align-grad-reduce",
        action="store_false",
        dest="align_grad_reduce",
        help="With --overlap-grad-reduce and pipeline parallelism, let each stage launch its gradient "
        "reductions on its own instead of all stages together.",
    )
    add_field_argument(
        group, DistributedDataParallelConfig, "bucket_size", flags=["--ddp-bucket-size"], dest="ddp_bucket_size"
    )
    add_field_argument(
        group,
        DistributedDataParallelConfig,
        "pad_buckets_for_high_nccl_busbw",
        flags=["--ddp-pad-buckets-for-high-nccl-busbw"],
        dest="ddp_pad_buckets_for_high_nccl_busbw",
    )
    add_field_argument(
        group,
        DistributedDataParallelConfig,
        "average_in_collective",
        flags=["--ddp-average-in-collective"],
        dest="ddp_average_in_collective",
    )
    add_field_argument(group, DistributedDataParallelConfig, "overlap_param_gather")
    add_field_argument(
        group, DistributedDataParallelConfig, "align_param_gather", flags=["--no-align-param-gather"], default=True
    )
    group.add_argument(
        "--local-rank",
        type=int,
        default=int(os.getenv("LOCAL_RANK", "0")),
        help="Local rank from the launcher (default: $LOCAL_RANK).",
    )
    add_field_argument(group, TransformerConfig, "account_for_embedding_in_pipeline_split")
    add_field_argument(group, TransformerConfig, "account_for_loss_in_pipeline_split")
    add_field_argument(group, DistributedDataParallelConfig, "use_distributed_optimizer")
    add_field_argument(group, DistributedDataParallelConfig, "num_distributed_optimizer_instances")
    add_field_argument(
        group,
        DistributedDataParallelConfig,
        "data_parallel_sharding_strategy",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
        default="optim_grads_params",
        help_suffix=" Read only with --use-megatron-fsdp (not supported yet).",
    )
    add_field_argument(group, DistributedDataParallelConfig, "gradient_reduce_div_fusion")
    add_field_argument(group, ModelParallelConfig, "context_parallel_size")
    return parser


def _add_validation_args(parser):
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-iters", type=int, default=100, help="Iterations of each validation/test run.")
    group.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="Iterations between two validation runs (default: no validation during training).",
    )
    group.add_argument(
        "--skip-train", action="store_true", help="Skip the training loop: only evaluate (if asked) and exit."
    )
    return parser


def _add_data_args(parser):
    group = parser.add_argument_group(title="data and dataloader")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Dataset prefixes (path without .bin/.idx) cut into train/valid/test by --split: one "
        "prefix, several prefixes (weighted by size) or 'weight prefix' pairs.",
    )
    add_field_argument(
        group,
        BlendedMegatronDatasetConfig,
        "split",
        help_suffix=" With --data-path and no --split, '969, 30, 1' is used (Megatron-LM's legacy default).",
    )
    for split in ("train", "valid", "test"):
        group.add_argument(
            f"--{split}-data-path",
            nargs="*",
            default=None,
            help=f"Dataset prefixes (as --data-path) read only for the {split} split.",
        )
    group.add_argument(
        "--data-args-path",
        type=str,
        default=None,
        help="File holding the --data-path list (for lists too long for the command line).",
    )
    group.add_argument(
        "--per-split-data-args-path",
        type=str,
        default=None,
        help="JSON file with 'train', 'valid' and 'test' keys holding per-split data-path lists.",
    )
    add_field_argument(
        group,
        BlendedMegatronDatasetConfig,
        "path_to_cache",
        flags=["--data-cache-path"],
        dest="data_cache_path",
        type=None,
    )
    add_field_argument(group, BlendedMegatronDatasetConfig, "mmap_bin_files")
    add_field_argument(group, BlendedMegatronDatasetConfig, "mock", flags=["--mock-data"], dest="mock_data")
    group.add_argument("--seq-length", type=int, default=None, help="Tokens per training sequence.")
    group.add_argument(
        "--encoder-seq-length", type=int, default=None, help="Another name for --seq-length (give one of them)."
    )
    group.add_argument("--num-workers", type=int, default=2, help="Data-loader worker processes.")
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        add_field_argument(group, GPTDatasetConfig, name, default=False)  # the config's None means "not given"
    add_field_argument(
        group,
        GPTDatasetConfig,
        "create_attention_mask",
        flags=["--no-create-attention-mask-in-dataloader"],
        dest="create_attention_mask_in_dataloader",
    )
    add_field_argument(group, BlendedMegatronDatasetConfig, "num_dataset_builder_threads")
    add_field_argument(group, BlendedMegatronDatasetConfig, "mid_level_dataset_surplus")
    return parser


def _add_tokenizer_args(parser):
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
    ("moe_per_layer_logging", {}),
    ("moe_apply_probs_on_input", {}),
    ("moe_router_force_load_balancing", {}),
)


def _add_moe_args(parser):
    group = parser.add_argument_group(title="moe")
    add_field_argument(group, ModelParallelConfig, "expert_model_parallel_size")
    add_field_argument(group, ModelParallelConfig, "expert_tensor_parallel_size")
    add_field_argument(group, TransformerConfig, "num_moe_experts", flags=["--num-experts"], dest="num_experts")
    for name, kwargs in _MOE_FIELD_FLAGS:
        add_field_argument(group, TransformerConfig, name, **kwargs)
    return parser


def _add_logging_args(parser):
    group = parser.add_argument_group(title="logging")
    group.add_argument("--log-params-norm", action="store_true", help="Compute and log the parameters' norm.")
    add_field_argument(group, OptimizerConfig, "log_num_zeros_in_grad")
    group.add_argument("--log-throughput", action="store_true", help="Log throughput (TFLOP/s per device).")
    group.add_argument(
        "--log-progress",
        action="store_true",
        help="Append the job's progress (start, checkpoints with throughput) to <--save>/progress.txt.",
    )
    group.add_argument(
        "--timing-log-level",
        type=int,
        default=0,
        choices=range(0, 3),
        help="Timers to report: 0 only the iteration time (no extra synchronisation), 1 also "
        "once-per-iteration operations, 2 also frequent operations.",
    )
    group.add_argument(
        "--no-barrier-with-level-1-timing",
        action="store_false",
        dest="barrier_with_L1_time",
        help="Do not put a barrier around level-1 timings.",
    )
    group.add_argument(
        "--timing-log-option",
        type=str,
        default="minmax",
        choices=["max", "minmax", "all"],
        help="Timer values to report across ranks: the max, min and max, or every rank's.",
    )
    group.add_argument(
        "--tensorboard-log-interval", type=int, default=1, help="Iterations between two TensorBoard writes."
    )
    group.add_argument(
        "--tensorboard-queue-size", type=int, default=1000, help="TensorBoard events queued before a flush to disk."
    )
    group.add_argument("--log-timers-to-tensorboard", action="store_true", help="Write the timers to TensorBoard.")
    group.add_argument(
        "--no-log-loss-scale-to-tensorboard",
        "--disable-log-loss-scale-to-tensorboard",
        action="store_false",
        dest="log_loss_scale_to_tensorboard",
        help="Do not write the loss scale to TensorBoard.",
    )
    group.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Write the validation perplexity to TensorBoard.",
    )
    group.add_argument("--log-memory-to-tensorboard", action="store_true", help="Write memory usage to TensorBoard.")
    group.add_argument(
        "--log-world-size-to-tensorboard", action="store_true", help="Write the world size to TensorBoard."
    )
    group.add_argument(
        "--wandb-project",
        type=str,
        default=None,
        help="Weights & Biases project (empty: no W&B). Set WANDB_MODE=offline to log offline.",
    )
    group.add_argument("--wandb-entity", type=str, default=None, help="Weights & Biases entity (team or user).")
    group.add_argument("--wandb-exp-name", type=str, default=None, help="Weights & Biases run name.")
    group.add_argument(
        "--wandb-save-dir",
        type=str,
        default=None,
        help="Local directory for Weights & Biases files (default: <--save>/wandb).",
    )
    group.add_argument("--logging-level", type=int, default=None, help="Python logging level (e.g. 20 for INFO).")
    group.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="Peak dense TFLOP/s of one device, for the MFU figure (default: looked up for known "
        "devices; MFU is not reported for an unknown one).",
    )
    return parser


def _add_transformer_engine_args(parser):
    group = parser.add_argument_group(title="Transformer-Engine")
    group.add_argument(
        "--transformer-impl",
        type=str,
        default="local",
        choices=["local", "transformer_engine", "inference_optimized"],
        help="Transformer implementation: local (pure PyTorch) or transformer_engine (NVIDIA "
        "Transformer Engine, optional here; without it, local runs with a warning). Megatron-LM's "
        "default is transformer_engine; this project's is local.",
    )
    return parser


def _add_deprecated_args(parser):
    """Megatron-LM's renamed flags: accepted so that validate_args can name their replacement."""
    group = argument_group(parser, "deprecated")
    for flag, replacement in argument_validation.DEPRECATED_FLAGS.items():
        if flag == "--checkpoint-activations":
            group.add_argument(flag, action="store_true", help=f"No longer valid: use {replacement}.")
        else:
            group.add_argument(flag, type=int, default=None, help=f"No longer valid: use {replacement}.")
    return parser


def _add_experimental_args(parser):
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
