"""``validate_args``: Megatron-LM's derived values and one clear error per inconsistent setting.

Runs on every rank before any process group exists, so a bad command line fails at once (never as a hang). Each
check is a small function over the argument namespace; each failure is a ``ValueError`` that names the flags, the
values and the fix. First come Megatron-LM's flags for what this project does not do (the tables of
``arguments_*_flags``): a feature not built yet is refused ("not supported yet: <feature> (--flag)"), a GPU-kernel or
vendor-service knob is reset with one warning. Settings that cannot apply on this machine (fused kernels, the nccl
backend without a GPU) are turned off with one warning too; ``--transformer-impl transformer_engine`` stays (the
model builds Transformer Engine's checkpoint layout from PyTorch modules, and says so).
"""

import math
import os
import re
from typing import List

import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.rank_generator import check_layout
from megatron.core.transformer.enums import CP_COMM_TYPES
from megatron.core.transformer.transformer_layer import layers_per_virtual_stage
from megatron.core.tokenizers.utils.build_tokenizer import TOKENIZER_TYPES as BUILT_TOKENIZER_TYPES
from megatron.core.utils import cuda_available, warn_once
from megatron.training.argument_validation_comm_overlap import validate_tp_comm_overlap_args
from megatron.training.argument_validation_fp8 import validate_fp8_args
from megatron.training.argument_validation_fsdp import validate_megatron_fsdp, validate_torch_fsdp2_args
from megatron.training.argument_validation_hybrid import has_pipeline_segments, validate_hybrid_args
from megatron.training.argument_validation_memory import validate_memory_args
from megatron.training.argument_validation_moe import validate_moe_args
from megatron.training.argument_validation_pipeline_layout import validate_pipeline_layout_flag
from megatron.training.flag_tables import DEPRECATED_FLAGS, FLAG_TABLES, TOKENIZER_TYPES, flag_for
from megatron.training.arguments_support import (
    FlagTable,
    ignore_flags_without_effect,
    refuse_features_not_built,
    value,
)

SUPPORTED_CKPT_FORMATS = ("torch_dist", "torch", "torch_dcp", "fsdp_dtensor")
LEGACY_DEFAULT_SPLIT = "969, 30, 1"

# Arguments that must be integers >= 1 (when set) and >= 0.
_POSITIVE_INTS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "num_query_groups",
    "seq_length",
    "max_position_embeddings",
    "micro_batch_size",
    "global_batch_size",
    "train_iters",
    "train_samples",
    "log_interval",
    "eval_interval",
    "save_interval",
    "exit_interval",
    "exit_duration_in_mins",
    "tensorboard_log_interval",
    "num_dataset_builder_threads",
    "make_vocab_size_divisible_by",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "microbatch_group_size_per_vp_stage",
    "recompute_num_layers",
    "lr_decay_iters",
    "lr_decay_samples",
    "lr_wsd_decay_iters",
    "lr_wsd_decay_samples",
    "distributed_timeout_minutes",
    "vocab_size",
    "ddp_bucket_size",
)
_NON_NEGATIVE_INTS = (
    "eval_iters",
    "lr_warmup_iters",
    "lr_warmup_samples",
    "num_workers",
    "manual_gc_interval",
    "vocab_extra_ids",
)
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")

# Implemented flags whose non-default values need a feature that is not built yet (the flags themselves are defined
# with the implemented ones in arguments.py; these rows only carry their defaults).
_NOT_BUILT_SETTINGS = (
    FlagTable(
        "distributed",
        (value("--num-distributed-optimizer-instances", int, 1),),
        not_supported="several distributed-optimizer instances",
    ),
)
_UNSUPPORTED_OPTIMIZERS = ("soap", "adaptive_muon")
_UNSUPPORTED_POSITION_EMBEDDINGS = {
    "yarn": "YaRN rotary embeddings",
    "mrope": "multimodal rotary embeddings (mrope)",
    "relative": "relative position embeddings (T5)",
}

# Which flags each tokenizer needs.
_TOKENIZER_FILES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}


def validate_args(args, defaults={}):
    """Check ``args`` (from ``parse_args``), fill in Megatron-LM's derived values and return ``args``.

    ``defaults`` are a script's own defaults (``args_defaults`` of ``initialize_megatron``): each applies when the
    command line left that argument at None. Derived: ``data_parallel_size``, ``global_batch_size``,
    ``virtual_pipeline_model_parallel_size``, ``ffn_hidden_size``, ``kv_channels``, ``params_dtype``, the weight-decay
    range, ``recompute_granularity`` for ``--recompute-activations``, the legacy ``--split`` and the run counters.
    The padded vocabulary size is set later, when the tokenizer is built.
    """
    _apply_script_defaults(args, defaults)
    _check_flag_support(args)
    _apply_aliases(args)
    validate_hybrid_args(args)  # may set --num-layers from --hybrid-layer-pattern
    _check_required(args)
    _check_integer_ranges(args)
    _validate_parallel_layout(args)
    validate_tp_comm_overlap_args(args)
    _validate_pipeline_split(args)
    _validate_batch_size(args)
    _validate_model_shape(args)
    _validate_positions(args)
    _validate_precision(args)
    validate_fp8_args(args)
    _validate_recompute(args)
    _validate_training_length(args)
    _validate_learning_rate(args)
    _validate_weight_decay(args)
    _validate_data_parallel(args)
    validate_memory_args(args)
    validate_torch_fsdp2_args(args)
    _validate_data(args)
    _validate_tokenizer(args)
    _validate_checkpointing(args)
    _validate_logging(args)
    _turn_off_what_cannot_run_here(args)
    validate_moe_args(args)
    _check_configs(args)
    _set_run_state(args)
    return args


def _check_configs(args) -> None:
    """Build the configs the run will build from these arguments, so that what only their own checks catch (the
    model's shape, MoE routing, recompute, the optimizer and gradient-reduction settings) fails now, before any
    process group, and in flag terms (``arguments.validate_args`` rewrites config field names into flags)."""
    from megatron.training.argument_utils import (
        core_ddp_config_from_args,
        core_optimizer_config_from_args,
        core_transformer_config_from_args,
    )

    core_transformer_config_from_args(args)
    core_optimizer_config_from_args(args)
    core_ddp_config_from_args(args)


def _is_rank_0(args) -> bool:
    return getattr(args, "rank", 0) == 0


def _not_training(args) -> bool:
    """Runs that never take an optimizer step: a layout report, or evaluation only."""
    return args.dry_run or args.skip_train


def _apply_script_defaults(args, defaults) -> None:
    for key, default in defaults.items():
        current = getattr(args, key, None)
        if current is None:
            setattr(args, key, default)
        elif _is_rank_0(args):
            print(f"WARNING: overriding default arguments for {key}:{default} with {key}:{current}", flush=True)


def _check_flag_support(args) -> None:
    """Megatron-LM's flags for what is not here: deprecated ones name their replacement, features not built yet are
    refused, knobs without effect are reset with a warning (see arguments_support)."""
    for flag, replacement in DEPRECATED_FLAGS.items():
        if getattr(args, flag[2:].replace("-", "_"), None) not in (None, False):
            raise ValueError(f"{flag} is no longer valid; use {replacement}")
    if args.num_experts == 0:
        args.num_experts = None
    unsupported_values = {
        "optimizer": {name: f"the {name} optimizer" for name in _UNSUPPORTED_OPTIMIZERS},
        "position_embedding_type": _UNSUPPORTED_POSITION_EMBEDDINGS,
        "rope_type": {"yarn": "multi-latent attention (MLA) and YaRN rotary scaling"},
        "transformer_impl": {"inference_optimized": "inference-optimized layers"},
        "moe_token_dispatcher_type": {"flex": "the flex token dispatcher (DeepEP / HybridEP kernels)"},
        "tokenizer_type": {name: f"the {name}" for name in TOKENIZER_TYPES if name not in BUILT_TOKENIZER_TYPES},
    }
    refuse_features_not_built(args, FLAG_TABLES + _NOT_BUILT_SETTINGS, unsupported_values)
    ignore_flags_without_effect(args, FLAG_TABLES)


def _apply_aliases(args) -> None:
    """Megatron-LM's second names of --seq-length and --num-layers, and its deprecated position-embedding flags."""
    for name, alias in (("seq_length", "encoder_seq_length"), ("num_layers", "encoder_num_layers")):
        given, aliased = getattr(args, name), getattr(args, alias)
        if given is not None and aliased is not None and given != aliased:
            raise ValueError(
                f"{flag_for(name)} ({given}) and {flag_for(alias)} ({aliased}) are two names for one setting; give one"
            )
        setattr(args, name, given if given is not None else aliased)
        setattr(args, alias, getattr(args, name))
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type not in ("rope", "none"):
        raise ValueError(
            "--no-position-embedding is deprecated: use --position-embedding-type rope or none (with "
            f"--position-embedding-type {args.position_embedding_type} the model has a position embedding)"
        )


def _check_required(args) -> None:
    missing = [flag_for(name) for name in _REQUIRED if getattr(args, name) is None]
    if missing:
        raise ValueError(f"missing required arguments: {', '.join(missing)}; give each a value")


def _check_integer_ranges(args) -> None:
    for names, lowest in ((_POSITIVE_INTS, 1), (_NON_NEGATIVE_INTS, 0)):
        for name in names:
            value = getattr(args, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lowest):
                kind = "a positive integer" if lowest == 1 else "an integer >= 0"
                raise ValueError(f"{flag_for(name)} must be {kind}, got {value!r}")


def _validate_parallel_layout(args) -> None:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    # The expert sizes are checked with the MoE flags (validate_moe_args); here etp = tp and ep = 1.
    args.data_parallel_size, _ = check_layout(args.world_size, tp, pp, cp, name=flag_for)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    if args.sequence_parallel and tp == 1:
        warn_once("--sequence-parallel has no effect with --tensor-model-parallel-size 1; turning it off")
        args.sequence_parallel = False
    _validate_context_parallel(args)
    if _is_rank_0(args):
        print(
            f"using world size: {args.world_size}, data-parallel size: {args.data_parallel_size}, context-parallel "
            f"size: {cp}, tensor-model-parallel size: {tp}, pipeline-model-parallel size: {pp}",
            flush=True,
        )


def _validate_context_parallel(args) -> None:
    """The sequence must split into 2 x CP load-balanced chunks (and each CP rank's share over TP under SP); the
    communication types and the a2a+p2p hierarchy must fit the layout."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    sizes = args.hierarchical_context_parallel_sizes
    if sizes and math.prod(sizes) != cp:
        raise ValueError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} multiply to {math.prod(sizes)}, not "
            f"--context-parallel-size {cp}; give sizes whose product is the context-parallel size"
        )
    comm_types = args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]
    for comm_type in comm_types:
        if comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type {comm_type} is not one of {', '.join(CP_COMM_TYPES)}")
    if len(comm_types) not in (1, args.num_layers):
        raise ValueError(
            f"--cp-comm-type has {len(comm_types)} values; give one, or one per layer (--num-layers {args.num_layers})"
        )
    if cp == 1 or args.seq_length is None:
        return
    if args.seq_length % (2 * cp) != 0:
        raise ValueError(
            f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size = {2 * cp} (the "
            "load-balanced split gives every CP rank two of 2 x CP equal chunks); change the sequence length or CP size"
        )
    if args.sequence_parallel and (args.seq_length // cp) % tp != 0:
        raise ValueError(
            f"--sequence-parallel splits each CP rank's {args.seq_length // cp} tokens over "
            f"--tensor-model-parallel-size {tp}, which does not divide them; use a --seq-length divisible by "
            f"{cp * tp}"
        )


def _validate_pipeline_split(args) -> None:
    if args.pipeline_model_parallel_layout is not None:
        validate_pipeline_layout_flag(args)
        return
    pp = args.pipeline_model_parallel_size
    layers_per_vstage = args.num_layers_per_virtual_pipeline_stage
    vstages_per_rank = args.num_virtual_stages_per_pipeline_rank
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    if layers_per_vstage is not None and vstages_per_rank is not None:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both set the "
            "virtual pipeline size; give only one of them"
        )
    interleaved = layers_per_vstage is not None or vstages_per_rank is not None
    if interleaved and pp == 1:
        raise ValueError(
            "the interleaved schedule (--num-layers-per-virtual-pipeline-stage / "
            "--num-virtual-stages-per-pipeline-rank) needs --pipeline-model-parallel-size > 1"
        )
    _check_layer_split(args, vpp=None)
    if layers_per_vstage is not None:
        if uneven:
            raise ValueError(
                "with --decoder-first/last-pipeline-num-layers, set the virtual pipeline size with "
                "--num-virtual-stages-per-pipeline-rank instead of --num-layers-per-virtual-pipeline-stage"
            )
        # Every stage holds the same share here (uneven splits were refused above), embedding/loss slots included.
        extras = int(args.account_for_embedding_in_pipeline_split) + int(args.account_for_loss_in_pipeline_split)
        layers_per_stage = (args.num_layers + extras) // pp
        if layers_per_stage % layers_per_vstage != 0:
            raise ValueError(
                f"each pipeline stage has {layers_per_stage} layers, not divisible by "
                f"--num-layers-per-virtual-pipeline-stage ({layers_per_vstage}); change one of them"
            )
        vpp = layers_per_stage // layers_per_vstage
    else:
        vpp = vstages_per_rank
    if vpp == 1:
        vpp = None
    if vpp is not None:
        if not args.overlap_p2p_comm and pp <= 2:
            raise ValueError(
                "the interleaved schedule with --no-overlap-p2p-communication needs --pipeline-model-parallel-size "
                f"> 2 (got {pp}); drop --no-overlap-p2p-communication or use more pipeline stages"
            )
        _check_layer_split(args, vpp)
    else:
        # Only the interleaved schedule overlaps pipeline communication or aligns parameter gathers.
        args.overlap_p2p_comm = False
        args.align_param_gather = False
    args.virtual_pipeline_model_parallel_size = vpp


def _check_layer_split(args, vpp) -> None:
    """The model's layers split over the pipeline stages and ``vpp`` virtual stages per rank (None: one); a hybrid
    layer pattern with '|' sets that split itself (argument_validation_hybrid checked it)."""
    if has_pipeline_segments(args):
        return
    if args.num_layers_per_virtual_pipeline_stage is not None:
        vpp_flag = "the virtual pipeline size from --num-layers-per-virtual-pipeline-stage"
    else:
        vpp_flag = "--num-virtual-stages-per-pipeline-rank"
    layers_per_virtual_stage_naming_flags(
        vpp_flag,
        num_layers=args.num_layers,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
    )


# The TransformerConfig fields that layers_per_virtual_stage's errors name -> the flags that set them (the virtual
# pipeline size is named by the flag that gave it).
_SPLIT_FIELD_FLAGS = {
    "num_layers": "--num-layers",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
    "num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
    "num_layers_in_first/last_pipeline_stage": "--decoder-first/last-pipeline-num-layers",
    "account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
    "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
}


def layers_per_virtual_stage_naming_flags(vpp_flag: str, **split) -> List[int]:
    """:func:`megatron.core.transformer.transformer_block.layers_per_virtual_stage` of the keyword arguments
    ``split``, its errors naming the command-line flags instead of the config fields (``vpp_flag`` for the virtual
    pipeline size), so that a message names what the user typed."""
    try:
        return layers_per_virtual_stage(**split)
    except ValueError as error:
        flags = dict(_SPLIT_FIELD_FLAGS, virtual_pipeline_model_parallel_size=vpp_flag)
        # Whole names only (\b): num_layers must not match inside num_layers_in_first_pipeline_stage.
        names = "|".join(re.escape(name) for name in flags)
        message = re.sub(rf"\b({names})\b", lambda match: flags[match.group(1)], str(error))
        raise ValueError(message) from None


def _validate_batch_size(args) -> None:
    if args.rampup_batch_size is not None and args.step_batch_size_schedule is not None:
        raise ValueError("--rampup-batch-size and --step-batch-size-schedule both schedule the batch size; give one")
    slice_size = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = slice_size
        if _is_rank_0(args):
            print(f"setting global batch size to {args.global_batch_size}", flush=True)
    gbs = args.global_batch_size
    if gbs < slice_size or (gbs % slice_size != 0 and not args.decrease_batch_size_if_needed):
        raise ValueError(
            f"--global-batch-size ({gbs}) must be a multiple of --micro-batch-size ({args.micro_batch_size}) x "
            f"data-parallel size ({args.data_parallel_size}) = {slice_size}; use a multiple of {slice_size} or "
            "change the micro-batch size or the number of processes"
        )


def _validate_model_shape(args) -> None:
    tp = args.tensor_model_parallel_size
    if args.swiglu and args.squared_relu:
        raise ValueError("--swiglu and --squared-relu choose different MLP activations; give only one of them")
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Two fc1 halves at 2/3 of 4h keep the parameter count of a 4h GELU MLP; a multiple of 64 stays
            # friendly to tensor-parallel splits.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
            if args.ffn_hidden_size == 0:
                raise ValueError(
                    f"--swiglu with --hidden-size {args.hidden_size} gives an FFN size of 0 (2/3 of 4h rounded "
                    "down to a multiple of 64); set --ffn-hidden-size"
                )
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads != 0:
            raise ValueError(
                f"--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads "
                f"({args.num_attention_heads}); change one of them or set --kv-channels"
            )
        args.kv_channels = args.hidden_size // args.num_attention_heads
    _check_divisible(args.num_attention_heads, "--num-attention-heads", tp, "--tensor-model-parallel-size")
    if args.group_query_attention:
        groups = args.num_query_groups
        if args.num_attention_heads % groups != 0:
            raise ValueError(
                f"--num-attention-heads ({args.num_attention_heads}) must be a multiple of --num-query-groups "
                f"({groups}): each key/value head serves the same number of query heads"
            )
        _check_divisible(groups, "--num-query-groups", tp, "--tensor-model-parallel-size")
    _check_divisible(args.ffn_hidden_size, "--ffn-hidden-size", tp, "--tensor-model-parallel-size")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ValueError(f"{flag_for(name)} must be in [0, 1), got {getattr(args, name)}")
    if not args.add_bias_linear:
        args.bias_gelu_fusion = False
    else:
        args.add_qkv_bias = True  # --add-qkv-bias only matters when the other biases are off


def _check_divisible(value, flag, divisor, divisor_flag) -> None:
    if value % divisor != 0:
        raise ValueError(
            f"{flag} ({value}) must be divisible by {divisor_flag} ({divisor}) so each rank holds an equal share; "
            f"change {flag} or {divisor_flag}"
        )


def _validate_positions(args) -> None:
    kind = args.position_embedding_type
    if args.max_position_embeddings is None:
        if kind == "learned_absolute":
            raise ValueError(
                "--max-position-embeddings is required with --position-embedding-type learned_absolute (it sizes "
                f"the learned position table); give at least --seq-length ({args.seq_length})"
            )
        args.max_position_embeddings = args.seq_length
    if kind == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        raise ValueError(
            f"--seq-length ({args.seq_length}) is larger than --max-position-embeddings "
            f"({args.max_position_embeddings}), the size of the learned position table; raise "
            "--max-position-embeddings or use --position-embedding-type rope"
        )
    if kind != "rope":
        args.apply_rope_fusion = False
        if args.use_rope_scaling:
            raise ValueError("--use-rope-scaling needs --position-embedding-type rope")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ValueError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")


def _validate_precision(args) -> None:
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are both set; choose one")
    args.params_dtype = torch.float
    if args.fp16:
        args.params_dtype = torch.half
        if not args.loss_scale:
            # With dynamic loss scaling, NaN/Inf gradients are the scaler's signal to back off, not an error.
            args.check_for_nan_in_loss_and_grad = False
    if args.bf16:
        args.params_dtype = torch.bfloat16
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16
    if args.fp16_lm_cross_entropy and not args.fp16:
        raise ValueError("--fp16-lm-cross-entropy needs --fp16")
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        raise ValueError("--fp32-residual-connection needs --fp16 or --bf16 (in fp32 the residual already is fp32)")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True


def _validate_recompute(args) -> None:
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    granularity = args.recompute_granularity
    if granularity == "full" and (args.recompute_method is None or args.recompute_num_layers is None):
        raise ValueError(
            "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers N"
        )
    if granularity != "full" and (args.recompute_method is not None or args.recompute_num_layers is not None):
        raise ValueError(
            "--recompute-method and --recompute-num-layers apply to --recompute-granularity full only; add it or "
            "drop them"
        )
    if args.recompute_modules is not None and granularity != "selective":
        raise ValueError("--recompute-modules applies to --recompute-granularity selective only; add it or drop them")
    if args.distribute_saved_activations:
        if args.tensor_model_parallel_size == 1 or granularity != "full":
            raise ValueError(
                "--distribute-saved-activations needs --tensor-model-parallel-size > 1 and --recompute-granularity full"
            )
        if args.sequence_parallel:
            raise ValueError(
                "--distribute-saved-activations cannot be combined with --sequence-parallel (the activations are "
                "already split); drop one of them"
            )


def _validate_training_length(args) -> None:
    if args.train_iters is not None and args.train_samples is not None:
        raise ValueError("give the training length once: --train-iters or --train-samples, not both")
    if args.train_iters is not None:
        for name in ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples", "rampup_batch_size"):
            if getattr(args, name):
                raise ValueError(
                    f"{flag_for(name)} counts samples, but --train-iters counts iterations; use the *-iters flag, or "
                    "--train-samples for sample-based training"
                )
    if args.train_samples is not None:
        for name in ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters"):
            if getattr(args, name):
                raise ValueError(
                    f"{flag_for(name)} counts iterations, but --train-samples counts samples; use the *-samples flag, "
                    "or --train-iters for iteration-based training"
                )
    if args.train_iters is None and args.train_samples is None and not _not_training(args):
        raise ValueError("give the training length: --train-iters N or --train-samples N (or --skip-train)")
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
        if args.lr_warmup_iters or args.lr_warmup_samples:
            raise ValueError(
                "give the warm-up once: --lr-warmup-fraction or --lr-warmup-iters/--lr-warmup-samples, not both"
            )


def _validate_learning_rate(args) -> None:
    if args.lr is None:
        if not _not_training(args):
            raise ValueError("--lr (the peak learning rate) is required for training")
    elif args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr}); lower --min-lr")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        raise ValueError(
            "--lr-decay-style WSD needs the length of its annealing phase: --lr-wsd-decay-iters or "
            "--lr-wsd-decay-samples"
        )


def _validate_weight_decay(args) -> None:
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            raise ValueError(
                "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine; with "
                "constant weight decay use --weight-decay"
            )
        args.start_weight_decay = args.weight_decay
        args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        raise ValueError(
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
            "--end-weight-decay"
        )


def _validate_data_parallel(args) -> None:
    validate_megatron_fsdp(args)
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")


def _validate_data(args) -> None:
    per_split = {"train": args.train_data_path, "valid": args.valid_data_path, "test": args.test_data_path}
    if args.data_path is not None and args.data_args_path is not None:
        raise ValueError("--data-path and --data-args-path both give the data; keep one of them")
    if any(path is not None for path in per_split.values()) and args.per_split_data_args_path is not None:
        raise ValueError(
            "--train/valid/test-data-path and --per-split-data-args-path both give the data; keep one of them"
        )
    sources = []
    if args.mock_data:
        sources.append("--mock-data")
    if args.data_path is not None or args.data_args_path is not None:
        sources.append("--data-path")
    if any(path is not None for path in per_split.values()) or args.per_split_data_args_path is not None:
        sources.append("--train/valid/test-data-path")
    if len(sources) > 1:
        raise ValueError(f"give one source of data, got {' and '.join(sources)}; keep one of them")
    if not sources and not args.dry_run:
        raise ValueError(
            "no data: give --data-path PREFIX (a .bin/.idx pair made by tools/preprocess_data.py), "
            "--train-data-path/--valid-data-path/--test-data-path, or --mock-data for synthetic data"
        )
    if args.data_path is not None and args.split is None:
        if _is_rank_0(args):
            print(
                f"WARNING: Please specify --split when using --data-path. Using legacy default value of "
                f'"{LEGACY_DEFAULT_SPLIT}"',
                flush=True,
            )
        args.split = LEGACY_DEFAULT_SPLIT
    if args.split is not None and "--train/valid/test-data-path" in sources:
        raise ValueError(
            "--split does not apply to --train/valid/test-data-path (each split has its own data); drop it"
        )
    for path_flag, path in (
        ("--data-args-path", args.data_args_path),
        ("--per-split-data-args-path", args.per_split_data_args_path),
    ):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{path_flag} {path}: file not found")
    _check_dataset_prefixes("--data-path", args.data_path)
    for split, paths in per_split.items():
        _check_dataset_prefixes(f"--{split}-data-path", paths)


def _check_dataset_prefixes(flag: str, paths) -> None:
    try:
        blend = get_blend_from_list(paths)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None
    if blend is None:
        return
    missing = [prefix for prefix in blend[0] if "://" not in prefix and not IndexedDataset.exists(prefix)]
    if missing:
        raise ValueError(
            f"{flag}: no dataset at {', '.join(missing)} ({{prefix}}.bin and {{prefix}}.idx must both exist); check "
            "the path, or build the files with tools/preprocess_data.py"
        )


def _validate_tokenizer(args) -> None:
    if args.tokenizer_type is None:
        raise ValueError(
            "--tokenizer-type is required, e.g. GPT2BPETokenizer with --vocab-file and --merge-file, "
            "HuggingFaceTokenizer with --tokenizer-model, or NullTokenizer with --vocab-size"
        )
    missing = [flag_for(name) for name in _TOKENIZER_FILES.get(args.tokenizer_type, ()) if getattr(args, name) is None]
    if missing:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs {' and '.join(missing)}")


def _validate_checkpointing(args) -> None:
    if args.ckpt_format not in SUPPORTED_CKPT_FORMATS:
        raise ValueError(
            f"--ckpt-format {args.ckpt_format} is not supported; this project reads and writes "
            f"{', '.join(SUPPORTED_CKPT_FORMATS)}"
        )
    for fmt in {args.ckpt_format, args.ckpt_convert_format} - {None, "torch_dist", "fsdp_dtensor"}:
        _validate_plain_ckpt_format(args, fmt)
    if args.ckpt_convert_format is not None:
        if args.ckpt_convert_save is None or args.load is None:
            raise ValueError("--ckpt-convert-format needs --load (the checkpoint) and --ckpt-convert-save (where to)")
        args.exit_on_missing_checkpoint = True  # converting nothing is an error, as in Megatron-LM
    if args.save is not None and args.save_interval is None:
        raise ValueError("--save needs --save-interval N (iterations between two saves)")
    if args.use_checkpoint_args and args.load is None:
        raise ValueError("--use-checkpoint-args needs --load (the checkpoint to take the arguments from)")
    if args.ckpt_fully_parallel_save_deprecated:
        warn_once("--ckpt-fully-parallel-save is deprecated and has no effect (fully parallel save is the default)")


def _validate_plain_ckpt_format(args, fmt: str) -> None:
    """The plain-state-dict formats: saved synchronously; ``torch_dcp`` holds one unsharded state for all ranks."""
    if args.async_save:
        raise ValueError(f"--async-save writes torch_dist checkpoints; not supported yet with the {fmt} format")
    sharded = [
        f"{flag} {getattr(args, name)}"
        for name, flag in (
            ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
            ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
            ("expert_model_parallel_size", "--expert-model-parallel-size"),
        )
        if getattr(args, name) > 1
    ] + (["--use-distributed-optimizer"] if args.use_distributed_optimizer else [])
    if fmt == "torch_dcp" and sharded:
        raise ValueError(
            f"the torch_dcp checkpoint format stores one plain, unsharded state dict for all ranks (Megatron-LM uses "
            f"it with FSDP2), which {', '.join(sharded)} would split; use --ckpt-format torch_dist (or torch)"
        )


def _validate_logging(args) -> None:
    if args.wandb_project:
        if not args.wandb_exp_name:
            raise ValueError("--wandb-project needs --wandb-exp-name (the name of this run)")
        if not args.wandb_save_dir and args.save is None:
            raise ValueError("--wandb-project needs --wandb-save-dir or --save (W&B files go to <save>/wandb)")
    if args.peak_flops is not None and args.peak_flops <= 0:
        raise ValueError(f"--peak-flops must be a positive number of TFLOP/s, got {args.peak_flops}")


def _turn_off_what_cannot_run_here(args) -> None:
    """GPU-only settings are accepted everywhere; where they cannot apply, turn them off and say so once (the
    PyTorch code that runs instead computes the same results). Every fusion flag runs megatron.core.fusions, on
    every device."""
    notes = []
    if args.distributed_backend == "nccl" and not cuda_available():
        args.distributed_backend = "gloo"
        notes.append("--distributed-backend nccl needs CUDA GPUs: using gloo")
    if args.gradient_accumulation_fusion and args.use_torch_fsdp2:
        # FSDP2 keeps gradients in param.grad: there is no main_grad for the weight-gradient GEMM to accumulate into.
        args.gradient_accumulation_fusion = False
        notes.append(
            "--use-torch-fsdp2 keeps no main_grad for gradient accumulation fusion to accumulate into: fusion off; "
            "pass --no-gradient-accumulation-fusion to silence this"
        )
    if notes:
        warn_once("; ".join(notes))


def _set_run_state(args) -> None:
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    args.consumed_valid_samples = 0
    # Set by data loaders that produce varying sequence lengths; a fixed length needs no shape exchange.
    args.variable_seq_lengths = False
    if args.dataloader_type is None:
        args.dataloader_type = "single"


def _print_args(title: str, args) -> None:
    """Print every argument on rank 0, in Megatron-LM's layout (once start-up has succeeded: a job that fails on
    a bad flag prints its error, not two hundred lines of settings first)."""
    if not _is_rank_0(args):
        return
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()]
    print(f"------------------------ {title} ------------------------", flush=True)
    for line in sorted(lines, key=str.lower):
        print(line, flush=True)
    print(f"-------------------- end of {title} ---------------------", flush=True)
