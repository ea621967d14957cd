"""``validate_args``' part for hybrid (Mamba) models: the layer pattern, its deprecated spellings and what it
decides (the number of layers, the pipeline split).

``--hybrid-layer-pattern`` sets the number of layers; ``--num-layers`` may be left out and, when given, must match.
``--hybrid-override-pattern`` (the old name) and ``--hybrid-attention-ratio`` / ``--hybrid-mlp-ratio`` (a pattern
made by ``pattern_from_ratios``) still work, each with Megatron's deprecation warning. A hybrid run without any of
them is all Mamba layers. ``|`` in the pattern fixes the pipeline stages (and with more segments than stages, the
virtual stages: ``--num-virtual-stages-per-pipeline-rank`` becomes ``segments / pp``).
"""

from megatron.core.models.hybrid.hybrid_layer_allocation import (
    Symbols,
    get_hybrid_total_layer_count,
    get_hybrid_total_pipeline_segment_count,
    pattern_from_ratios,
    refuse_layer_types_not_built,
)
from megatron.core.utils import warn_once


def _warn(args, message: str) -> None:
    if getattr(args, "rank", 0) == 0:
        warn_once(message)


def has_pipeline_segments(args) -> bool:
    """Whether ``--hybrid-layer-pattern`` fixes the pipeline split with ``|``."""
    return Symbols.PIPE in (getattr(args, "hybrid_layer_pattern", None) or "").split(Symbols.MTP_SEPARATOR)[0]


def validate_hybrid_args(args) -> None:
    """Resolve the deprecated pattern flags into ``args.hybrid_layer_pattern``, derive ``num_layers`` (and the
    virtual pipeline size) from it and check it; ``args.is_hybrid_model`` is True for any hybrid run."""
    _resolve_deprecated_flags(args)
    if args.hybrid_layer_pattern is None and args.is_hybrid_model:
        if args.num_layers is None:
            raise ValueError("a hybrid model needs --hybrid-layer-pattern (or --num-layers for an all-Mamba model)")
        args.hybrid_layer_pattern = Symbols.MAMBA * args.num_layers
    pattern = args.hybrid_layer_pattern
    if pattern is None:
        return
    args.is_hybrid_model = True
    if getattr(args, "pipeline_model_parallel_layout", None) is not None:
        raise ValueError(
            "--pipeline-model-parallel-layout places GPT layers; a hybrid model's pipeline stages come from '|' in "
            "--hybrid-layer-pattern, so drop --pipeline-model-parallel-layout"
        )
    refuse_layer_types_not_built(pattern, flag="--hybrid-layer-pattern")
    if Symbols.MOE in pattern and not args.num_experts:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r} has MoE layers ('E') but --num-experts is not set; pass "
            "--num-experts (and --moe-ffn-hidden-size, --moe-router-topk, ...) or use '-' (MLP) layers"
        )
    num_layers = get_hybrid_total_layer_count(pattern)
    if args.num_layers is None:
        args.num_layers = num_layers
    elif args.num_layers != num_layers:
        raise ValueError(
            f"--num-layers ({args.num_layers}) does not match the {num_layers} layers of --hybrid-layer-pattern "
            f"{pattern!r}; leave --num-layers out (the pattern sets it) or fix the pattern"
        )
    args.encoder_num_layers = args.num_layers
    _validate_pipeline_segments(args, pattern)
    if args.recompute_granularity == "full":
        raise ValueError(
            "not supported yet: --recompute-granularity full for hybrid models; use --recompute-granularity "
            "selective (attention's core) or no recomputation"
        )


def _resolve_deprecated_flags(args) -> None:
    if args.hybrid_override_pattern is not None:
        if args.hybrid_layer_pattern is not None:
            raise ValueError(
                "--hybrid-override-pattern and --hybrid-layer-pattern cannot both be given; --hybrid-override-pattern "
                "is deprecated, so give --hybrid-layer-pattern alone"
            )
        _warn(args, "--hybrid-override-pattern has been deprecated. Use --hybrid-layer-pattern instead.")
        args.hybrid_layer_pattern, args.hybrid_override_pattern = args.hybrid_override_pattern, None
    attention_ratio, mlp_ratio = args.hybrid_attention_ratio or 0.0, args.hybrid_mlp_ratio or 0.0
    if not (attention_ratio or mlp_ratio):
        return
    if args.hybrid_layer_pattern is not None:
        raise ValueError(
            "--hybrid-layer-pattern cannot be used together with --hybrid-attention-ratio or --hybrid-mlp-ratio; "
            "the ratios are deprecated, so give the pattern alone"
        )
    _warn(
        args,
        "--hybrid-attention-ratio and --hybrid-mlp-ratio have been deprecated. Use --hybrid-layer-pattern instead.",
    )
    if args.num_layers is None:
        raise ValueError("--hybrid-attention-ratio / --hybrid-mlp-ratio need --num-layers (the layers they divide)")
    try:
        args.hybrid_layer_pattern = pattern_from_ratios(args.num_layers, attention_ratio, mlp_ratio)
    except ValueError as error:
        message = (
            str(error).replace("attention_ratio", "--hybrid-attention-ratio").replace("mlp_ratio", "--hybrid-mlp-ratio")
        )
        raise ValueError(message) from None
    args.hybrid_attention_ratio = args.hybrid_mlp_ratio = 0.0
    args.is_hybrid_model = True


def _validate_pipeline_segments(args, pattern: str) -> None:
    segments = get_hybrid_total_pipeline_segment_count(pattern)
    pp = args.pipeline_model_parallel_size
    interleaving = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    if segments == 1:
        if any(value is not None for value in interleaving):
            raise ValueError(
                "virtual pipeline stages of a hybrid model are set by '|' in --hybrid-layer-pattern (one segment "
                "per virtual stage), not by --num-layers-per-virtual-pipeline-stage / "
                "--num-virtual-stages-per-pipeline-rank"
            )
        return
    if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r} sets the pipeline stages with '|'; do not also give "
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
        )
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r} sets the virtual pipeline stages with '|'; do not also give "
            "--num-layers-per-virtual-pipeline-stage"
        )
    if pp == 1:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r} has {segments} '|'-separated pipeline segments but "
            "--pipeline-model-parallel-size is 1; remove the '|' or use one pipeline stage per segment"
        )
    if segments % pp != 0:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r} has {segments} '|'-separated segments, not divisible by "
            f"--pipeline-model-parallel-size ({pp}); give one segment per pipeline stage (or per virtual stage)"
        )
    per_rank = segments // pp
    given = args.num_virtual_stages_per_pipeline_rank
    if given is not None and given != per_rank:
        raise ValueError(
            f"--num-virtual-stages-per-pipeline-rank ({given}) does not match --hybrid-layer-pattern {pattern!r}: "
            f"{segments} segments on {pp} pipeline stages make {per_rank} per rank; leave the flag out"
        )
    args.num_virtual_stages_per_pipeline_rank = per_rank if per_rank > 1 else None
