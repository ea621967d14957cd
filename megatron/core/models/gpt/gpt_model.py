"""GPTModel: embedding -> transformer block -> output layer, one pipeline stage of it per rank."""

from typing import Any, Callable, Dict, Literal, Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


class GPTModel(LanguageModule):
    """A decoder-only transformer language model (GPT, Llama and friends, by config and layer spec).

    ``forward(input_ids [b, s], position_ids [b, s], attention_mask)`` returns the per-token loss ``[b, s]`` when
    ``labels`` are given, else logits ``[b, s, v/tp]`` (``[b, s, v]`` with ``parallel_output=False``). A stage
    without ``post_process`` returns its hidden states ``[s, b, h]`` for the next stage.

    ``position_embedding_type``: 'learned_absolute' (GPT-2), 'rope' (Llama), 'mrope' (multimodal RoPE: position
    ids ``[3, b, s]`` and ``config.mrope_section``), or 'none'; 'yarn' is not supported yet.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal["learned_absolute", "rope", "mrope", "yarn", "none"] = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        mtp_block_spec: Optional[ModuleSpec] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
    ) -> None:
        super().__init__(config, pg_collection)
        if mtp_block_spec is not None:
            raise ValueError("not supported yet: multi-token prediction (mtp_block_spec); pass None")
        if position_embedding_type == "yarn":
            raise ValueError("not supported yet: YaRN rotary embeddings (position_embedding_type='yarn')")
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
        self.transformer_layer_spec = transformer_layer_spec

        # The embedding adds learned positions only; rotary kinds are applied in attention.
        self._build_embedding(
            "none" if position_embedding_type == "mrope" else position_embedding_type,
            scatter_embedding_sequence_parallel,
        )
        if position_embedding_type == "mrope":
            self.mrope_section = config.mrope_section
            if not self.mrope_section:
                raise ValueError(
                    "position_embedding_type='mrope' needs config.mrope_section (channel pairs per "
                    "temporal / height / width section)"
                )
            self.rotary_pos_emb = MultimodalRotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
            )
        if position_embedding_type == "rope":
            self._build_rotary_embedding(
                rotary_percent,
                rotary_base,
                seq_len_interpolation_factor,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
                cp_group=self._context_parallel_group(pg_collection),
            )
        self.decoder = TransformerBlock(
            config=config,
            spec=transformer_layer_spec,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        self._build_output_layer()

    # One implementation (LanguageModule's), also bound here because Megatron's API has it on the model class.
    set_input_tensor = LanguageModule.set_input_tensor

    def _context_parallel_group(self, pg_collection):
        """The CP group rotary angles are split over (this rank's chunks of the sequence), or None without CP."""
        if self.config.context_parallel_size == 1:
            return None
        if getattr(pg_collection, "cp", None) is not None:
            return pg_collection.cp
        return parallel_state.get_context_parallel_group()

    def _decoder_rotary_pos_emb(self, position_ids, inference_context, decoder_input, packed_seq_params):
        """Multimodal RoPE takes its angles from the ``[3, b, s]`` position ids; other kinds as LanguageModule."""
        if self.position_embedding_type == "mrope":
            return self.rotary_pos_emb(position_ids, self.mrope_section)
        return super()._decoder_rotary_pos_emb(position_ids, inference_context, decoder_input, packed_seq_params)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input: torch.Tensor = None,
        labels: torch.Tensor = None,
        inference_context: Any = None,
        packed_seq_params: PackedSeqParams = None,
        extra_block_kwargs: dict = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params: Optional[Any] = None,
        loss_mask: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        output_processor: Optional[Callable[..., torch.Tensor]] = None,
        output_processor_context: Optional[Any] = None,
    ) -> torch.Tensor:
        """``loss_mask`` matters to multi-token prediction only (not built); ``padding_mask`` goes to the layers'
        MLPs. Custom output processors are not supported yet."""
        if output_processor is not None:
            raise ValueError("not supported yet: GPTModel.forward(output_processor=...)")
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
            extra_block_kwargs,
        )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[Dict] = None
    ) -> Dict[str, Any]:
        """LanguageModule's sharded state without the output layer's (always empty) extra state, which Megatron's
        GPT checkpoints do not store."""
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sharded_state_dict.pop(f"{prefix}output_layer._extra_state", None)
        return sharded_state_dict
