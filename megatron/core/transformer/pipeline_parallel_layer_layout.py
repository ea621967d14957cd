"""PipelineParallelLayerLayout: which layers each (virtual) pipeline stage holds, as Megatron's layout string says.

A layout lists the stages in pipeline order (every rank's first model chunk, then every rank's second, ...); each
stage lists its layers: ``E`` the embedding, ``t`` a transformer (decoder) layer, ``m`` a multi-token-prediction
layer, ``L`` the loss (output layer). In the string form ``|`` separates stages, ``x*n`` repeats a character,
``(...)*n`` repeats a group (which may hold separators) and commas are ignored: ``"Et*3|(tt|)*29,m|L"`` is 32
stages. With ``S`` stages on ``pipeline_model_parallel_size`` ranks there are ``S / pp`` virtual stages per rank.

``TransformerConfig(pipeline_model_parallel_layout=...)`` turns a string or list into this class, checks it and
takes its virtual pipeline size; the transformer block then builds ``get_num_layers_to_build`` layers from global
layer ``get_layer_offset`` on.
"""

import copy
import logging
import re
from functools import lru_cache
from typing import List, Optional, Union

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType

logger = logging.getLogger(__name__)

_LAYER_OF_CHAR = {"E": LayerType.embedding, "L": LayerType.loss, "t": LayerType.decoder, "m": LayerType.mtp}
# "(ab|c)*2" -> "ab|cab|c" first, then "x*3" -> "xxx".
_GROUP_REPEAT = re.compile(r"\(([^()]+)\)\*(\d+)")
_CHAR_REPEAT = re.compile(r"(.)\*(\d+)")


def _as_layer_type(item) -> LayerType:
    if isinstance(item, LayerType):
        return item
    if not isinstance(item, str):
        raise ValueError(
            f"pipeline_model_parallel_layout: a stage's layers must be LayerType values or their names, got "
            f"{type(item).__name__} {item!r}; give one list of layer names per stage"
        )
    name = item.strip().lower()
    if name not in LayerType.__members__:
        raise ValueError(
            f"pipeline_model_parallel_layout: {item!r} is not a valid LayerType; use one of "
            f"{sorted(LayerType.__members__)}"
        )
    return LayerType[name]


class PipelineParallelLayerLayout:
    """The layers of every pipeline stage: ``layout[pp_rank][vp_stage]`` is a list of :class:`LayerType`.

    Args:
        layout: a layout string, or one list of layers (``LayerType`` or names such as ``"decoder"``) per stage in
            pipeline order.
        pipeline_model_parallel_size: the number of pipeline ranks; it must divide the number of stages.
    """

    def __init__(self, layout: Union[str, list], pipeline_model_parallel_size: int):
        self.input_data = layout
        stages = self.parse_str_to_list(layout) if isinstance(layout, str) else copy.deepcopy(layout)
        if not isinstance(stages, list) or not all(isinstance(stage, list) for stage in stages):
            raise ValueError(
                f"pipeline_model_parallel_layout must be a layout string or a list of lists (one per stage), got "
                f"{layout!r}"
            )
        pp = pipeline_model_parallel_size
        if not isinstance(pp, int) or pp < 1 or len(stages) % pp != 0:
            raise ValueError(
                f"pipeline_model_parallel_layout has {len(stages)} stages, not a multiple of "
                f"pipeline_model_parallel_size ({pp}); give pp x (virtual stages per rank) stages"
            )
        vpp = len(stages) // pp
        typed = [[_as_layer_type(item) for item in stage] for stage in stages]
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = vpp
        # Stage s of the pipeline order is chunk s // pp of rank s % pp.
        self.layout = [[typed[vp_stage * pp + pp_rank] for vp_stage in range(vpp)] for pp_rank in range(pp)]
        self.flatten_layout = [layer for stage in typed for layer in stage]

    def __repr__(self) -> str:
        return self.input_data if isinstance(self.input_data, str) else str(self.input_data)

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: Optional[int]) -> bool:
        """Check the layout against the model; return whether the MTP layers sit on a rank before the last
        (Megatron's ``mtp_standalone``)."""
        flat = self.flatten_layout
        if LayerType.encoder in flat:
            raise ValueError("pipeline_model_parallel_layout: encoder layers are not supported in a pipeline layout")
        if not flat or flat[0] != LayerType.embedding:
            raise ValueError(
                f"pipeline_model_parallel_layout: the first layer must be embedding ('E'), got "
                f"{flat[0].name if flat else 'nothing'}; start the first stage with E"
            )
        if flat[-1] != LayerType.loss:
            raise ValueError(
                f"pipeline_model_parallel_layout: the last layer must be loss ('L'), got {flat[-1].name}; end the "
                "last stage with L"
            )
        for layer_type, char in ((LayerType.embedding, "E"), (LayerType.loss, "L")):
            if flat.count(layer_type) != 1:
                raise ValueError(
                    f"pipeline_model_parallel_layout: {layer_type.name} ('{char}') must appear exactly once, it "
                    f"appears {flat.count(layer_type)} times"
                )
        decoders = flat.count(LayerType.decoder)
        if decoders != num_layers:
            raise ValueError(
                f"pipeline_model_parallel_layout has {decoders} decoder layers ('t') but num_layers is {num_layers}; "
                "make them equal"
            )
        return self._validate_mtp(mtp_num_layers or 0)

    def _validate_mtp(self, mtp_num_layers: int) -> bool:
        flat = self.flatten_layout
        count = flat.count(LayerType.mtp)
        if count != mtp_num_layers:
            raise ValueError(
                f"pipeline_model_parallel_layout has {count} MTP layers ('m') but mtp_num_layers is "
                f"{mtp_num_layers or None}; make them equal"
            )
        if count == 0:
            return False
        if LayerType.decoder in flat[flat.index(LayerType.mtp) :]:
            raise ValueError("pipeline_model_parallel_layout: decoder layers must be placed before the MTP layers")
        for pp_rank, chunks in enumerate(self.layout):
            if any(LayerType.mtp in chunk for chunk in chunks[:-1]):
                raise ValueError(
                    f"pipeline_model_parallel_layout: MTP layers must be in the last virtual stage of their rank "
                    f"(rank {pp_rank} holds {chunks})"
                )
        holders = [rank for rank, chunks in enumerate(self.layout) if LayerType.mtp in chunks[-1]]
        if len(holders) != 1 or self.layout[holders[0]][-1].count(LayerType.mtp) != count:
            raise ValueError("pipeline_model_parallel_layout: all MTP layers must be in one virtual stage")
        return holders[0] != self.pipeline_model_parallel_size - 1

    def _stage(self, vp_stage: Optional[int], pp_rank: Optional[int]):
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
            vp_stage = 0
        elif vp_stage is None:
            raise ValueError("vp_stage must be passed when virtual pipeline parallelism is on")
        return pp_rank, vp_stage

    def get_num_layers_to_build(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
    ) -> int:
        """How many ``layer_type`` layers chunk ``vp_stage`` of rank ``pp_rank`` (this rank when None) holds."""
        pp_rank, vp_stage = self._stage(vp_stage, pp_rank)
        return self.layout[pp_rank][vp_stage].count(layer_type)

    def get_layer_offset(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
    ) -> int:
        """How many ``layer_type`` layers come before chunk ``vp_stage`` of rank ``pp_rank`` in pipeline order."""
        pp_rank, vp_stage = self._stage(vp_stage, pp_rank)
        pp = self.pipeline_model_parallel_size
        earlier = [self.layout[r][c] for c in range(vp_stage + 1) for r in range(pp if c < vp_stage else pp_rank)]
        return sum(stage.count(layer_type) for stage in earlier)

    def get_layer_id_list(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
    ) -> List[int]:
        """The global (0-based) indices of the ``layer_type`` layers of that chunk."""
        offset = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(offset, offset + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    def layers_per_virtual_stage(self, layer_type: LayerType = LayerType.decoder) -> List[int]:
        """``layer_type`` counts of every stage in pipeline order (chunk ``c`` of rank ``r`` at ``c * pp + r``)."""
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        return [self.layout[r][c].count(layer_type) for c in range(vpp) for r in range(pp)]

    def pretty_repr(self) -> str:
        """A table of what each rank holds per virtual stage, equal consecutive ranks merged (``PP rank 1-13``)."""

        def describe(stage):
            runs = []
            for layer in stage:
                if runs and runs[-1][0] == layer:
                    runs[-1][1] += 1
                else:
                    runs.append([layer, 1])
            return ",".join(f"{t.name}*{n}" if n > 1 else t.name for t, n in runs) or "(empty stage)"

        vpp = self.virtual_pipeline_model_parallel_size
        rows = [[""] + [f"VPP rank {c}" for c in range(vpp)]] if vpp > 1 else []
        cells = [[describe(stage) for stage in chunks] for chunks in self.layout]
        start = 0
        for rank in range(1, len(cells) + 1):
            if rank == len(cells) or cells[rank] != cells[start]:
                label = f"PP rank {start}" if rank - 1 == start else f"PP rank {start}-{rank - 1}"
                rows.append([label] + cells[start])
                start = rank
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        gap = " " * (8 if vpp <= 4 else 4)
        return "\n".join(gap.join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)

    @staticmethod
    @lru_cache()
    def from_str(layout: str, pipeline_model_parallel_size: int) -> "PipelineParallelLayerLayout":
        """Parse a layout string (cached: configs built many times share one object) and log its table."""
        parsed = PipelineParallelLayerLayout(layout, pipeline_model_parallel_size)
        logger.info("pipeline model parallel layout %s:\n%s", layout, parsed.pretty_repr())
        return parsed

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        """How many stages (pipeline x virtual) a layout string describes."""
        return len(PipelineParallelLayerLayout.parse_str_to_list(layout))

    @staticmethod
    def parse_str_to_list(layout_str: str) -> List[List[LayerType]]:
        """``"Et|(tt|)*2,L"`` -> ``[[embedding, decoder], [decoder, decoder], [decoder, decoder], [loss]]``."""
        expanded = layout_str.replace(",", "")
        expanded = _GROUP_REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), expanded)
        expanded = _CHAR_REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), expanded)
        stages = []
        for stage in expanded.split("|"):
            unknown = sorted(set(stage) - set(_LAYER_OF_CHAR))
            if unknown:
                raise ValueError(
                    f"pipeline_model_parallel_layout {layout_str!r}: invalid layer character {unknown[0]!r} in stage "
                    f"{stage!r}; known layer characters: {list(_LAYER_OF_CHAR)} ('|' separates stages, 'x*n' and "
                    "'(...)*n' repeat)"
                )
            stages.append([_LAYER_OF_CHAR[char] for char in stage])
        return stages
