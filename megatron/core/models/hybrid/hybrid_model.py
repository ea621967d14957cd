"""HybridModel: embedding -> HybridStack (Mamba / attention / MLP layers from a pattern) -> output layer."""

import logging
from typing import Any, Dict, Literal, Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.hybrid.hybrid_layer_allocation import (
    Symbols,
    get_hybrid_total_layer_count,
    get_hybrid_total_pipeline_segment_count,
    parse_hybrid_pattern,
    pattern_from_ratios,
    refuse_layer_types_not_built,
    select_pipeline_segment,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import warn_once

logger = logging.getLogger(__name__)


def _warn_on_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        warn_once(message)


def resolve_hybrid_layer_pattern(
    num_layers: int,
    hybrid_layer_pattern: Optional[str] = None,
    hybrid_attention_ratio: Optional[float] = None,
    hybrid_mlp_ratio: Optional[float] = None,
    hybrid_override_pattern: Optional[str] = None,
) -> str:
    """The layer pattern from ``hybrid_layer_pattern`` or the deprecated settings (with Megatron's deprecation
    warnings): ``hybrid_override_pattern`` is the old name of the pattern, the ratios make one with
    :func:`pattern_from_ratios` (all Mamba layers when none is given). Conflicting settings are a ValueError."""
    pattern = hybrid_layer_pattern
    if hybrid_override_pattern is not None:
        if pattern is not None:
            raise ValueError(
                "hybrid_override_pattern and hybrid_layer_pattern cannot both be set; hybrid_override_pattern is "
                "deprecated, so give hybrid_layer_pattern (--hybrid-layer-pattern) alone"
            )
        _warn_on_rank_0("hybrid_override_pattern has been deprecated. Use hybrid_layer_pattern instead.")
        pattern = hybrid_override_pattern
    ratios_given = bool(hybrid_attention_ratio) or bool(hybrid_mlp_ratio)
    if ratios_given:
        if pattern is not None:
            raise ValueError(
                "hybrid_layer_pattern cannot be used together with hybrid_attention_ratio or hybrid_mlp_ratio "
                f"(got {hybrid_attention_ratio!r} / {hybrid_mlp_ratio!r}); the ratios are deprecated, so give the "
                "pattern alone"
            )
        _warn_on_rank_0(
            "hybrid_attention_ratio and hybrid_mlp_ratio have been deprecated. Use hybrid_layer_pattern instead."
        )
    if pattern is None:
        pattern = pattern_from_ratios(num_layers, hybrid_attention_ratio or 0.0, hybrid_mlp_ratio or 0.0)
    return pattern


def _pipeline_group(pg_collection: Optional[ProcessGroupCollection], config: TransformerConfig):
    group = getattr(pg_collection, "pp", None)
    if group is None and config.pipeline_model_parallel_size > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
    return group


class HybridModel(LanguageModule):
    """A language model whose layers follow ``hybrid_layer_pattern``: ``M`` Mamba-2, ``*`` self-attention, ``-``
    MLP, ``|`` between pipeline segments (see :mod:`hybrid_layer_allocation`).

    The embedding, output layer, loss and tied embeddings are the ones GPTModel uses (LanguageModule). Positions:
    'none' (the default: Mamba layers carry position themselves), 'learned_absolute' or 'rope' for the attention
    layers; 'yarn' is not supported yet. ``config.num_layers`` must equal the pattern's layer count.
    ``forward(input_ids [b, s], position_ids [b, s], attention_mask)`` returns the per-token loss ``[b, s]`` with
    ``labels``, else logits ``[b, s, v/tp]``; a stage without ``post_process`` returns hidden states ``[s, b, h]``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hybrid_stack_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        hybrid_layer_pattern: Optional[str] = None,
        hybrid_attention_ratio: Optional[float] = None,
        hybrid_mlp_ratio: Optional[float] = None,
        hybrid_override_pattern: Optional[str] = None,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = "none",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
    ) -> None:
        super().__init__(config, pg_collection)
        pattern = resolve_hybrid_layer_pattern(
            config.num_layers,
            hybrid_layer_pattern,
            hybrid_attention_ratio,
            hybrid_mlp_ratio,
            hybrid_override_pattern,
        )
        self._check_settings(config, pattern, position_embedding_type)
        self._init_language_model_settings(
            vocab_size,
            max_sequence_length,
            pre_process,
            post_process,
            fp16_lm_cross_entropy,
            parallel_output,
            share_embeddings_and_output_weights,
            position_embedding_type,
            vp_stage,
        )
        self.hybrid_stack_spec = hybrid_stack_spec
        self.hybrid_layer_pattern = pattern

        main_pattern = parse_hybrid_pattern(pattern).main_pattern or ""
        layer_type_list, layer_offset = select_pipeline_segment(
            main_pattern,
            _pipeline_group(pg_collection, config),
            vp_stage,
            first_stage_layers=config.num_layers_in_first_pipeline_stage,
            last_stage_layers=config.num_layers_in_last_pipeline_stage,
            tp_group=getattr(pg_collection, "tp", None),
            dp_cp_group=getattr(pg_collection, "dp_cp", None),
        )
        self._build_embedding(position_embedding_type, scatter_embedding_sequence_parallel)
        if position_embedding_type == "rope":
            self._build_rotary_embedding(rotary_percent, rotary_base, seq_len_interpolation_factor)
        self.decoder = build_module(
            hybrid_stack_spec,
            config,
            pre_process=pre_process,
            layer_type_list=layer_type_list,
            pp_layer_offset=layer_offset,
            post_process=post_process,
            dtype=config.params_dtype,
            pg_collection=pg_collection,
            name="decoder",
        )
        self._build_output_layer()

    @staticmethod
    def _check_settings(config, pattern, position_embedding_type) -> None:
        """Everything a bad setting would break later, checked before any module (or collective) is built (the
        vocabulary size in LanguageModule)."""
        refuse_layer_types_not_built(pattern)
        num_layers = get_hybrid_total_layer_count(pattern)
        if config.num_layers != num_layers:
            raise ValueError(
                f"config.num_layers ({config.num_layers}) must equal the number of layers in the hybrid layer "
                f"pattern {pattern!r} ({num_layers}); set num_layers to {num_layers} (--num-layers may be left out "
                "with --hybrid-layer-pattern)"
            )
        segments = get_hybrid_total_pipeline_segment_count(pattern)
        chunks = config.pipeline_model_parallel_size * (config.virtual_pipeline_model_parallel_size or 1)
        if segments > 1 and segments != chunks:
            raise ValueError(
                f"the hybrid layer pattern {pattern!r} has {segments} '|'-separated segments but the model has "
                f"{chunks} pipeline model chunks (pipeline_model_parallel_size "
                f"{config.pipeline_model_parallel_size} x virtual_pipeline_model_parallel_size "
                f"{config.virtual_pipeline_model_parallel_size or 1}); give one segment per chunk"
            )
        if position_embedding_type == "yarn":
            raise ValueError("not supported yet: YaRN rotary embeddings (position_embedding_type='yarn')")
        if position_embedding_type == "rope" and Symbols.ATTENTION not in pattern:
            _warn_on_rank_0(f"position_embedding_type='rope' has no effect: pattern {pattern!r} has no attention")

    # One implementation (LanguageModule's), also bound here because Megatron's API has it on the model class.
    set_input_tensor = LanguageModule.set_input_tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input: torch.Tensor = None,
        labels: torch.Tensor = None,
        inference_context: Any = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params: Optional[Any] = None,
        loss_mask: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        padding_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``loss_mask`` only matters to multi-token prediction (not built); the loss is per token and masked by
        the caller's loss function, as in pretrain_gpt."""
        inference_context = inference_context if inference_context is not None else inference_params
        return self._language_model_forward(
            input_ids,
            position_ids,
            attention_mask,
            decoder_input,
            labels,
            inference_context,
            packed_seq_params,
            padding_mask,
            runtime_gather_output,
        )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[Dict] = None
    ) -> Dict[str, Any]:
        """LanguageModule's sharded state without the output layer's (always empty) extra state, which Megatron's
        checkpoints do not store."""
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sharded_state_dict.pop(f"{prefix}output_layer._extra_state", None)
        return sharded_state_dict
