"""What a parallel layout puts where, computed without process groups: the rank groups, the layers of each pipeline
stage and virtual chunk, and the parameters each stage holds. ``--dry-run`` prints this before any training.

Rank groups come from :class:`megatron.core.rank_generator.RankGenerator`, the same enumeration
``initialize_model_parallel`` uses. Layers per stage come from ``transformer_block.layers_per_virtual_stage``, the
split ``get_num_layers_to_build`` and ``get_transformer_layer_offset`` use (they ask the process groups for the
pipeline rank; this module takes the rank as a number). Parameter counts are exact for the GPT model built from the
local layer spec, biases included, and for a hybrid model (``--hybrid-layer-pattern``, whose ``|`` segments fix the
layers of each stage) for the local hybrid spec, each chunk listing its layer kinds.
"""

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron.core.rank_generator import (
    RankGenerator,
    _check_expert_layout_matches_pipeline,
    check_layout,
    default_embedding_ranks,
)
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.training.argument_validation import layers_per_virtual_stage_naming_flags
from megatron.training.model_arithmetic import (
    hybrid_layer_parameters,
    moe_layer_pattern,
    moe_mlp_parameters,
    required_arg,
    transformer_layer_parameters,
    transformer_moe_layer_parameters,
)

# How many groups of one kind to list before summarising the rest.
_GROUPS_SHOWN = 8


@dataclass(frozen=True)
class PipelineChunk:
    """One model chunk: pipeline rank ``pipeline_rank``'s chunk ``virtual_rank`` (0 without virtual stages)."""

    pipeline_rank: int
    virtual_rank: int
    first_layer: int
    num_layers: int
    has_embedding: bool
    has_output: bool

    @property
    def layers(self) -> range:
        """Global (0-based) indices of the chunk's layers, as in the checkpoint keys ``decoder.layers.<i>``."""
        return range(self.first_layer, self.first_layer + self.num_layers)


@dataclass(frozen=True)
class ParallelLayout:
    """Rank groups by kind (lists of global ranks) and the model chunks in pipeline-rank, then chunk, order."""

    world_size: int
    sizes: Dict[str, int]
    order: str
    groups: Dict[str, List[List[int]]]
    chunks: List[PipelineChunk]

    def stage_ranks(self, pipeline_rank: int) -> List[int]:
        """Every global rank that runs pipeline stage ``pipeline_rank``."""
        return sorted(group[pipeline_rank] for group in self.groups["pipeline-parallel"])


@dataclass(frozen=True)
class LayoutRequest:
    """A layout to compute: the parallel sizes (``etp=None`` means ``etp = tp``), the rank order and how the layers
    split into (virtual) pipeline stages; the one bundle that parallel_layout and describe_parallel_layout share."""

    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: Optional[int]
    order: str
    num_layers: int
    vpp: Optional[int] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    hybrid_layer_pattern: Optional[str] = None
    pipeline_model_parallel_layout: Optional[str] = None

    @classmethod
    def from_args(cls, args) -> "LayoutRequest":
        """The layout of Megatron-LM's parsed and validated args."""
        return cls(
            args.world_size,
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            getattr(args, "context_parallel_size", 1),
            getattr(args, "expert_model_parallel_size", 1),
            getattr(args, "expert_tensor_parallel_size", None),
            # Megatron-LM's --use-tp-pp-dp-mapping swaps the pp and dp axes.
            "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp",
            args.num_layers,
            getattr(args, "virtual_pipeline_model_parallel_size", None),
            getattr(args, "decoder_first_pipeline_num_layers", None),
            getattr(args, "decoder_last_pipeline_num_layers", None),
            getattr(args, "account_for_embedding_in_pipeline_split", False),
            getattr(args, "account_for_loss_in_pipeline_split", False),
            getattr(args, "hybrid_layer_pattern", None),
            getattr(args, "pipeline_model_parallel_layout", None),
        )


def layers_per_virtual_stage(
    num_layers: int,
    pp: int,
    vpp: Optional[int] = None,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
) -> List[int]:
    """Layer counts of the virtual stages in pipeline order (virtual stage ``c * pp + r`` is chunk ``c`` of
    pipeline rank ``r``): ``transformer_block.layers_per_virtual_stage`` under this module's argument names, its
    errors naming the command-line flags (``vpp`` is ``--num-virtual-stages-per-pipeline-rank``)."""
    return layers_per_virtual_stage_naming_flags(
        "--num-virtual-stages-per-pipeline-rank",
        num_layers=num_layers,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        account_for_embedding_in_pipeline_split=account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=account_for_loss_in_pipeline_split,
    )


def pipeline_chunks(per_virtual_stage: List[int], pp: int) -> List[PipelineChunk]:
    """The chunks of :func:`layers_per_virtual_stage`'s split, ordered by pipeline rank, then chunk."""
    offsets = [sum(per_virtual_stage[:index]) for index in range(len(per_virtual_stage))]
    last = len(per_virtual_stage) - 1
    chunks = [
        PipelineChunk(
            pipeline_rank=index % pp,
            virtual_rank=index // pp,
            first_layer=offsets[index],
            num_layers=count,
            has_embedding=index == 0,
            has_output=index == last,
        )
        for index, count in enumerate(per_virtual_stage)
    ]
    return sorted(chunks, key=lambda chunk: (chunk.pipeline_rank, chunk.virtual_rank))


def parallel_layout(
    world_size: int,
    tp: int,
    pp: int,
    cp: int,
    ep: int,
    etp: Optional[int],
    order: str,
    num_layers: int,
    vpp: Optional[int] = None,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
    hybrid_layer_pattern: Optional[str] = None,
    pipeline_model_parallel_layout: Optional[str] = None,
) -> ParallelLayout:
    """The rank groups and layer placement ``initialize_model_parallel`` and the model would create, checked the
    same way (``etp=None`` means ``etp = tp``). A hybrid pattern with ``|`` gives each virtual stage one segment;
    a pipeline layout string (``--pipeline-model-parallel-layout``) places the layers itself."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    # The check initialize_model_parallel runs, so a layout reported here is one that would start.
    dp, expert_dp = check_layout(world_size, tp, pp, cp, ep, etp, virtual_pipeline_model_parallel_size=vpp)
    etp = tp if etp is None else etp
    sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "dp": dp, "expert_dp": expert_dp}

    decoder = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=order)
    _check_expert_layout_matches_pipeline(order, pp, dp, expert_dp, decoder.get_ranks("pp"), expert.get_ranks("pp"))
    pipelines = decoder.get_ranks("pp")
    groups = {
        "tensor-parallel": decoder.get_ranks("tp"),
        "pipeline-parallel": pipelines,
        "data-parallel": decoder.get_ranks("dp"),
        "context-parallel": decoder.get_ranks("cp"),
        "data-parallel with context": decoder.get_ranks("dp-cp"),
        "expert-model-parallel": expert.get_ranks("ep"),
        "expert-tensor-parallel": expert.get_ranks("tp"),
        "expert-data-parallel": expert.get_ranks("dp"),
        # The word embedding's first-stage and last-stage copies (tied weights all-reduce over this group).
        "embedding": [default_embedding_ranks(ranks) for ranks in pipelines],
    }
    segments = (hybrid_layer_pattern or "").split(Symbols.MTP_SEPARATOR)[0].split(Symbols.PIPE)
    if len(segments) > 1:
        per_virtual_stage = [len(segment) for segment in segments]
        if len(per_virtual_stage) != pp * (vpp or 1):
            raise ValueError(
                f"--hybrid-layer-pattern {hybrid_layer_pattern!r} has {len(segments)} segments for {pp} pipeline "
                f"stages x {vpp or 1} virtual stages; give one segment per virtual stage"
            )
    elif pipeline_model_parallel_layout is not None:
        per_virtual_stage = PipelineParallelLayerLayout(pipeline_model_parallel_layout, pp).layers_per_virtual_stage()
    else:
        per_virtual_stage = layers_per_virtual_stage(
            num_layers,
            pp,
            vpp,
            first_stage_layers,
            last_stage_layers,
            account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split,
        )
    return ParallelLayout(world_size, sizes, order, groups, pipeline_chunks(per_virtual_stage, pp))


def stage_parameter_counts(model_args, layout: ParallelLayout) -> List[Tuple[int, int]]:
    """(parameters of the whole stage, parameters on one of its ranks) for each pipeline rank, for the model of
    Megatron-LM's ``model_args`` built from the local layer spec (a tied output layer's copy on the last stage
    counts, as it is a parameter there). One rank holds its tensor-parallel share of the dense weights and, in MoE
    layers (``--num-experts``, ``--moe-layer-freq``), its ``1 / EP`` of the routed experts, split over expert-TP.
    Hybrid models (``--hybrid-layer-pattern``) count each layer by its kind (``E`` layers' experts as above)."""
    tp, ep, etp = layout.sizes["tp"], layout.sizes["ep"], layout.sizes["etp"]
    hybrid_pattern = (getattr(model_args, "hybrid_layer_pattern", None) or "").split(Symbols.MTP_SEPARATOR)[0]
    layer_kinds = hybrid_pattern.replace(Symbols.PIPE, "")
    dense_layer = transformer_layer_parameters(model_args) + (0, 0) if not layer_kinds else None
    moe_layer = (
        transformer_moe_layer_parameters(model_args, ep, etp)
        if getattr(model_args, "num_experts", None) and not layer_kinds
        else None
    )
    pattern = moe_layer_pattern(model_args) if moe_layer is not None else None

    def layer_counts(layer: int) -> Tuple[int, int, int, int]:
        if layer_kinds and layer_kinds[layer] == Symbols.MOE:
            return moe_mlp_parameters(model_args, ep, etp)
        if layer_kinds:
            return hybrid_layer_parameters(model_args, layer_kinds[layer]) + (0, 0)
        return moe_layer if pattern and pattern[layer] else dense_layer

    hidden = model_args.hidden_size
    vocab = required_arg(model_args, "padded_vocab_size", "build the tokenizer (it pads the vocabulary) first")
    norm = hidden * (1 if model_args.normalization == "RMSNorm" else 2)
    positions = 0
    if model_args.position_embedding_type == "learned_absolute":
        positions = hidden * required_arg(model_args, "max_position_embeddings", "pass --max-position-embeddings")

    # [split over TP, replicated, routed experts in the stage, routed experts on one rank] per pipeline rank
    counts = [[0, 0, 0, 0] for _ in range(layout.sizes["pp"])]
    for chunk in layout.chunks:
        stage = counts[chunk.pipeline_rank]
        for layer in chunk.layers:
            for index, value in enumerate(layer_counts(layer)):
                stage[index] += value
        if chunk.has_embedding:
            stage[0] += vocab * hidden
            stage[1] += positions
        if chunk.has_output:
            stage[1] += norm
            # A tied output layer reuses the embedding on the same chunk; another chunk keeps a copy.
            if model_args.untie_embeddings_and_output_weights or not chunk.has_embedding:
                stage[0] += vocab * hidden
    return [
        (split + replicated + experts, split // tp + replicated + experts_per_rank)
        for split, replicated, experts, experts_per_rank in counts
    ]


def describe_parallel_layout(
    world_size: int,
    tp: int,
    pp: int,
    cp: int,
    ep: int,
    etp: Optional[int],
    order: str,
    num_layers: int,
    vpp: Optional[int] = None,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    *,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
    model_args=None,
) -> str:
    """A readable report of :func:`parallel_layout`: rank groups, each stage's ranks and layers (with their kinds
    for a hybrid), and with ``model_args`` (Megatron-LM's args) the parameters per stage."""
    request = LayoutRequest(
        world_size,
        tp,
        pp,
        cp,
        ep,
        etp,
        order,
        num_layers,
        vpp,
        first_stage_layers,
        last_stage_layers,
        account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split,
        getattr(model_args, "hybrid_layer_pattern", None),
    )
    return describe_layout(request, model_args)


def describe_parallel_layout_for_args(args) -> str:
    """:func:`describe_parallel_layout` for Megatron-LM's parsed and validated args (as ``--dry-run`` uses it)."""
    return describe_layout(LayoutRequest.from_args(args), args)


def describe_layout(request: LayoutRequest, model_args=None) -> str:
    """The report of :func:`describe_parallel_layout` for one :class:`LayoutRequest`."""
    layout = parallel_layout(**dataclasses.asdict(request))
    world_size, tp, pp, cp, ep = request.world_size, request.tp, request.pp, request.cp, request.ep
    order, num_layers, vpp, pattern = request.order, request.num_layers, request.vpp, request.hybrid_layer_pattern
    layer_kinds = (pattern or "").split(Symbols.MTP_SEPARATOR)[0].replace(Symbols.PIPE, "")
    sizes = layout.sizes
    lines = [
        f"Parallel layout: {world_size} ranks = TP {tp} x CP {cp} x DP {sizes['dp']} x PP {pp}, order {order}",
        f"Expert layout: ETP {sizes['etp']} x EP {ep} x expert-DP {sizes['expert_dp']} x PP {pp}",
        "Rank groups (global ranks):",
    ]
    width = max(len(kind) for kind in layout.groups)
    for kind, groups in layout.groups.items():
        lines.append(f"  {kind:<{width}}  {_format_groups(groups)}")
    if cp > 1:
        lines.append(_describe_context_parallel(cp, model_args))

    stage_parameters = stage_parameter_counts(model_args, layout) if model_args is not None else None
    virtual = f", {vpp} virtual stages per rank" if vpp else ""
    lines.append(f"Pipeline stages ({num_layers} layers{virtual}; layer i is decoder.layers.<i>):")
    for rank in range(pp):
        chunks = [chunk for chunk in layout.chunks if chunk.pipeline_rank == rank]
        lines.append(f"  stage {rank} on ranks {_format_ranks(layout.stage_ranks(rank))}")
        for chunk in chunks:
            label = f"chunk {chunk.virtual_rank}: " if vpp else ""
            lines.append(f"    {label}{_describe_chunk(chunk, layer_kinds)}")
        if stage_parameters is not None:
            total, per_rank = stage_parameters[rank]
            moe = getattr(model_args, "num_experts", None)
            where = "per rank (TP share + 1/EP of the experts)" if moe else "per tensor-parallel rank"
            lines.append(f"    parameters: {total:,} in the stage, {per_rank:,} {where}")
    return "\n".join(lines)


def _describe_context_parallel(cp: int, model_args) -> str:
    """Which part of every sequence a CP rank holds (the load-balanced split) and how attention communicates."""
    seq = getattr(model_args, "seq_length", None)
    tokens = f"{seq // cp} of {seq} tokens: " if seq else ""
    comm_type = getattr(model_args, "cp_comm_type", None) or ["p2p"]
    comm = " ".join(comm_type) if isinstance(comm_type, list) else comm_type
    return (
        f"Context parallelism: every sequence is cut into {2 * cp} chunks and CP rank r holds chunks r and "
        f"{2 * cp - 1}-r ({tokens}load-balanced for causal attention); attention communicates by {comm}"
    )


def _describe_chunk(chunk: PipelineChunk, layer_kinds: str = "") -> str:
    layers = chunk.layers
    if not layers:
        text = "no layers"
    elif len(layers) == 1:
        text = f"layer {layers[0]}"
    else:
        text = f"layers {layers[0]}-{layers[-1]}"
    if layers and layer_kinds:
        text += f" ({layer_kinds[layers[0] : layers[-1] + 1]})"
    extras = [
        name
        for name, present in (("embedding", chunk.has_embedding), ("final norm + output layer", chunk.has_output))
        if present
    ]
    return text + (f" + {' + '.join(extras)}" if extras else "")


def _format_ranks(ranks: List[int]) -> str:
    return "[" + ", ".join(str(rank) for rank in ranks) + "]"


def _format_groups(groups: List[List[int]]) -> str:
    shown = " ".join(_format_ranks(group) for group in groups[:_GROUPS_SHOWN])
    more = len(groups) - _GROUPS_SHOWN
    return shown + (f" ... ({more} more)" if more > 0 else "")
