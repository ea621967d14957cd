"""Validation of ``--pipeline-model-parallel-layout``: the layout places every layer and gives the virtual pipeline
size, so the other pipeline-split flags must stay unset; its errors name the flags the user typed."""

from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

_FIELD_FLAGS = (
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("mtp_num_layers", "--mtp-num-layers"),
    ("num_layers", "--num-layers"),
)


def validate_pipeline_layout_flag(args) -> None:
    """Check the layout against --pipeline-model-parallel-size and --num-layers; set
    ``args.virtual_pipeline_model_parallel_size`` from it (None for one stage per rank)."""
    pp = args.pipeline_model_parallel_size
    others = {
        "--num-layers-per-virtual-pipeline-stage": args.num_layers_per_virtual_pipeline_stage,
        "--num-virtual-stages-per-pipeline-rank": args.num_virtual_stages_per_pipeline_rank,
        "--decoder-first-pipeline-num-layers": args.decoder_first_pipeline_num_layers,
        "--decoder-last-pipeline-num-layers": args.decoder_last_pipeline_num_layers,
        "--account-for-embedding-in-pipeline-split": args.account_for_embedding_in_pipeline_split or None,
        "--account-for-loss-in-pipeline-split": args.account_for_loss_in_pipeline_split or None,
    }
    conflicts = [flag for flag, value in others.items() if value is not None]
    if conflicts:
        raise ValueError(
            f"--pipeline-model-parallel-layout cannot be combined with {', '.join(conflicts)}; the layout places "
            "every layer and sets the virtual stages itself, so drop them"
        )
    try:
        layout = PipelineParallelLayerLayout(args.pipeline_model_parallel_layout, pp)
        layout.validate_layer_layout(args.num_layers, getattr(args, "mtp_num_layers", None))
    except ValueError as error:
        message = str(error)
        for field, flag in _FIELD_FLAGS:
            message = message.replace(field, flag)
        raise ValueError(message) from None
    vpp = layout.virtual_pipeline_model_parallel_size
    if vpp > 1 and pp == 1:
        raise ValueError(
            f"--pipeline-model-parallel-layout gives {vpp} stages on one pipeline rank; virtual stages need "
            "--pipeline-model-parallel-size > 1, so give one stage per pipeline rank"
        )
    if vpp > 1 and not args.overlap_p2p_comm and pp <= 2:
        raise ValueError(
            "the interleaved schedule with --no-overlap-p2p-communication needs --pipeline-model-parallel-size "
            f"> 2 (got {pp}); drop --no-overlap-p2p-communication or use more pipeline stages"
        )
    if vpp == 1:
        # Only the interleaved schedule overlaps pipeline communication or aligns parameter gathers.
        args.overlap_p2p_comm = False
        args.align_param_gather = False
    args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
