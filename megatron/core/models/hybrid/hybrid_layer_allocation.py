"""The hybrid layer pattern: one character per layer, ``|`` between pipeline segments, ``/`` before MTP depths.

``"M-M*-|M-M-"`` is a four-plus-four layer model on two pipeline stages: Mamba, MLP, Mamba, attention, MLP | Mamba,
MLP, Mamba, MLP. The number of layers is the number of layer symbols. Megatron-Core's symbols are all recognised
(so counts, FLOPs and checkpoints of any pattern can be reasoned about); :func:`refuse_layer_types_not_built` says
which of them this project cannot build yet.
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.parallel_state import log_on_each_pipeline_stage

logger = logging.getLogger(__name__)


class Symbols:
    """The pattern's characters: one per layer type, plus the two separators."""

    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"
    MOE = "E"
    GDN = "G"
    DS_ATTENTION = "D"
    MLA = "+"
    PIPE = "|"
    MTP_SEPARATOR = "/"
    VALID_LAYERS = {MAMBA, ATTENTION, MLP, MOE, GDN, DS_ATTENTION, MLA}

    @classmethod
    def name_sorted_valid_layer_symbols(cls) -> list[str]:
        """The layer symbols ordered by their names here (ATTENTION, DS_ATTENTION, GDN, MAMBA, MLA, MLP, MOE): the
        key order of :func:`get_hybrid_layer_counts`."""
        names = [name for name, value in vars(cls).items() if isinstance(value, str) and value in cls.VALID_LAYERS]
        return [getattr(cls, name) for name in sorted(names)]


# Layer types Megatron-Core has that are not built here, and where each one is being built.
_NOT_BUILT = {
    Symbols.GDN: "Gated DeltaNet layers ('G')",
    Symbols.DS_ATTENTION: "DeepSeek sparse-attention layers ('D')",
    Symbols.MLA: "multi-latent attention layers ('+')",
}


@dataclass
class ParsedHybridPattern:
    """A pattern split at ``/``: the main decoder pattern (may hold ``|``), the MTP pattern of one depth, and the
    number of MTP depths (``"M*M*/MM/MM"``: main ``M*M*``, MTP ``MM``, 2 depths)."""

    main_pattern: Optional[str]
    mtp_pattern: Optional[str]
    mtp_num_depths: int


def _validate_pattern(pattern: str, allow_pipe: bool, what: str = "hybrid layer pattern") -> None:
    for position, char in enumerate(pattern):
        if char in Symbols.VALID_LAYERS or (allow_pipe and char == Symbols.PIPE):
            continue
        allowed = "".join(Symbols.name_sorted_valid_layer_symbols())
        where = " (pipeline separators '|' go in the main pattern only)" if char == Symbols.PIPE else ""
        raise ValueError(
            f"{what} {pattern!r}: {char!r} at position {position} is not a layer symbol{where}; use 'M' (Mamba), "
            f"'*' (attention), '-' (MLP), 'E' (MoE) (all of Megatron's: {allowed!r}), '|' between pipeline "
            "stages and '/' before MTP depths"
        )


def parse_hybrid_pattern(pattern: Optional[str]) -> ParsedHybridPattern:
    """Split ``pattern`` into its main and MTP parts, checking every symbol; every MTP depth must repeat the same
    pattern. None parses to an empty result."""
    if pattern is None:
        return ParsedHybridPattern(None, None, 0)
    main, *mtp_parts = pattern.split(Symbols.MTP_SEPARATOR)
    _validate_pattern(main, allow_pipe=True)
    if not any(mtp_parts):
        return ParsedHybridPattern(main or None, None, 0)
    for depth, part in enumerate(mtp_parts, start=1):
        if part != mtp_parts[0]:
            raise ValueError(
                f"hybrid layer pattern {pattern!r}: every MTP depth must have the same pattern, but depth 1 is "
                f"{mtp_parts[0]!r} and depth {depth} is {part!r}"
            )
    _validate_pattern(mtp_parts[0], allow_pipe=False, what="MTP pattern")
    return ParsedHybridPattern(main or None, mtp_parts[0], len(mtp_parts))


def get_hybrid_total_layer_count(pattern: str) -> int:
    """Layers of the main decoder (the symbols before any ``/``, without the ``|`` separators)."""
    main = parse_hybrid_pattern(pattern).main_pattern or ""
    return len(main.replace(Symbols.PIPE, ""))


def get_hybrid_total_pipeline_segment_count(pattern: str) -> int:
    """Pipeline segments of the main pattern: one more than its ``|`` separators."""
    return pattern.split(Symbols.MTP_SEPARATOR)[0].count(Symbols.PIPE) + 1


def get_hybrid_layer_counts(pattern: str) -> Dict[str, int]:
    """Layers of each type in the main pattern plus every MTP depth, keyed by every layer symbol (in
    :meth:`Symbols.name_sorted_valid_layer_symbols` order): ``"M*M*"`` has 2 ``M`` and 2 ``*``."""
    parsed = parse_hybrid_pattern(pattern)
    counts = {symbol: 0 for symbol in Symbols.name_sorted_valid_layer_symbols()}
    for char in (parsed.main_pattern or "").replace(Symbols.PIPE, ""):
        counts[char] += 1
    for char in parsed.mtp_pattern or "":
        counts[char] += parsed.mtp_num_depths
    return counts


def validate_segment_layers(segment: str) -> List[str]:
    """One pipeline segment (no ``|``) as its list of layer symbols."""
    _validate_pattern(segment, allow_pipe=False, what="pipeline segment")
    return list(segment)


def refuse_layer_types_not_built(pattern: Optional[str], flag: str = "hybrid_layer_pattern") -> None:
    """A ValueError naming the layer types of ``pattern`` this project cannot build yet, and an MTP part (``/``)."""
    if pattern is None:
        return
    parsed = parse_hybrid_pattern(pattern)
    used = set((parsed.main_pattern or "") + (parsed.mtp_pattern or ""))
    missing = [text for symbol, text in _NOT_BUILT.items() if symbol in used]
    if parsed.mtp_num_depths:
        missing.append(f"multi-token prediction ('/{parsed.mtp_pattern}' x {parsed.mtp_num_depths})")
    if missing:
        raise ValueError(
            f"not supported yet: {'; '.join(missing)} in {flag} {pattern!r}; build the model from 'M' (Mamba), "
            "'*' (attention), '-' (MLP) and 'E' (MoE) layers"
        )


def pattern_from_ratios(num_layers: int, attention_ratio: float = 0.0, mlp_ratio: float = 0.0) -> str:
    """The pattern of the deprecated ratio settings: ``round(num_layers * attention_ratio)`` attention layers
    spread evenly between Mamba runs (the pattern starts and ends with Mamba when there is room), then
    ``round(num_layers * mlp_ratio)`` of the remaining Mamba layers turned into MLP layers, spread evenly too.
    ``pattern_from_ratios(8, 0.25, 0.0)`` is ``"MM*MM*MM"``.

    Both placements walk the layers with a running budget: a layer is converted when less than half a layer of
    the current gap is left, after which the budget grows by one gap.
    """
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"pattern_from_ratios: num_layers must be a positive integer, got {num_layers!r}")
    for name, ratio in (("attention_ratio", attention_ratio), ("mlp_ratio", mlp_ratio)):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"pattern_from_ratios: {name} must be in [0, 1], got {ratio!r}")
    if attention_ratio + mlp_ratio > 1.0:
        raise ValueError(
            f"pattern_from_ratios: attention_ratio ({attention_ratio}) + mlp_ratio ({mlp_ratio}) must be at most 1 "
            "(the rest of the layers are Mamba layers)"
        )
    layers = [Symbols.MAMBA] * num_layers
    attention_count = round(num_layers * attention_ratio)
    mamba_count = num_layers - attention_count
    _spread(layers, Symbols.ATTENTION, mamba_count / (attention_count + 1))
    mlp_count = round(num_layers * mlp_ratio)
    if mlp_count > 0:
        _spread(layers, Symbols.MLP, (mamba_count - mlp_count) / mlp_count)
    return "".join(layers)


def _spread(layers: List[str], symbol: str, gap: float) -> None:
    """Turn Mamba layers into ``symbol`` every ``gap`` Mamba layers (in place)."""
    budget = gap
    for index, layer in enumerate(layers):
        if layer != Symbols.MAMBA:
            continue
        if budget < 0.5:
            layers[index] = symbol
            budget += gap
        else:
            budget -= 1


def _even_or_uneven_slice(
    num_layers: int, pp_rank: int, pp_size: int, first: Optional[int], last: Optional[int]
) -> Tuple[int, int]:
    """(offset, count) of pipeline rank ``pp_rank``'s layers when the pattern has no ``|``: the pipeline split of
    transformer models (even, or with fixed first/last stage sizes)."""
    from megatron.core.transformer.transformer_layer import layers_per_virtual_stage

    per_rank = layers_per_virtual_stage(
        num_layers, pp_size, None, num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last
    )
    return sum(per_rank[:pp_rank]), per_rank[pp_rank]


def select_pipeline_segment(
    main_pattern: str,
    pp_group: Optional[torch.distributed.ProcessGroup],
    vp_stage: Optional[int],
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
    dp_cp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Tuple[List[str], int]:
    """This model chunk's layer symbols and the global index of its first layer.

    With ``|`` separators, segment ``vp_stage * pp_size + pp_rank`` (the interleaved schedule's order) is this
    chunk's, and the number of segments must be a multiple of the pipeline size. Without them the layers are split
    over the pipeline ranks like a transformer's (evenly, or with ``first/last_stage_layers``), which cannot serve
    virtual stages. The choice is logged once per stage (``tp_group`` / ``dp_cp_group`` pick the logging rank).
    """
    segments = main_pattern.split(Symbols.PIPE)
    pp_rank = pp_group.rank() if pp_group is not None else 0
    pp_size = pp_group.size() if pp_group is not None else 1
    if len(segments) > 1:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError(
                f"hybrid layer pattern {main_pattern!r} sets the pipeline stages with '|'; do not also set "
                "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage "
                "(--decoder-first/last-pipeline-num-layers)"
            )
        if len(segments) % pp_size != 0:
            raise ValueError(
                f"hybrid layer pattern {main_pattern!r} has {len(segments)} pipe-separated segments, not divisible "
                f"by pipeline_model_parallel_size ({pp_size}); give one segment per pipeline stage (or per "
                "virtual stage)"
            )
        index = (vp_stage or 0) * pp_size + pp_rank
        if index >= len(segments):
            raise ValueError(
                f"hybrid layer pattern {main_pattern!r}: pipeline rank {pp_rank}, virtual stage {vp_stage} needs "
                f"segment {index} but the pattern has {len(segments)}; add '|'-separated segments"
            )
        offset = sum(len(segment) for segment in segments[:index])
        layers = validate_segment_layers(segments[index])
    else:
        if pp_size > 1 and vp_stage is not None:
            raise ValueError(
                f"hybrid layer pattern {main_pattern!r} has no '|' separators, so it cannot be split into virtual "
                "pipeline stages; mark every virtual stage's layers with '|'"
            )
        layers = validate_segment_layers(main_pattern)
        offset = 0
        if pp_size > 1:
            offset, count = _even_or_uneven_slice(len(layers), pp_rank, pp_size, first_stage_layers, last_stage_layers)
            layers = layers[offset : offset + count]
    log_on_each_pipeline_stage(
        logger,
        logging.INFO,
        f"HybridModel: pp_rank={pp_rank}/{pp_size}, vp_stage={vp_stage}, layers='{''.join(layers)}' "
        f"({len(layers)} layers), layer_offset={offset}",
        tp_group=tp_group,
        dp_cp_group=dp_cp_group,
    )
    return layers, offset


def get_layer_maps_from_layer_type_list(layer_type_list: list[str]) -> dict[str, dict[int, int]]:
    """For each layer symbol, ``{index in layer_type_list: index among the layers of that type}`` (the inference
    caches number Mamba and attention layers separately)."""
    maps: dict[str, dict[int, int]] = {symbol: {} for symbol in Symbols.name_sorted_valid_layer_symbols()}
    for index, symbol in enumerate(layer_type_list):
        maps[symbol][index] = len(maps[symbol])
    return maps
