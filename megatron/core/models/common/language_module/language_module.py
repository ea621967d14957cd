"""LanguageModule: what every language model shares — the LM loss and the tied input/output embedding."""

import logging
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.fusions.kernel_dispatch import fallback_notice
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.parallel_state import tp_group_or_default
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.config_validation import require_model_sizes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.tensor_parallel.sharded_state import make_tp_sharded_tensor_for_checkpoint
from megatron.core.utils import layout_independent_init

logger = logging.getLogger(__name__)


class LanguageModule(MegatronModule):
    """Base class of GPTModel (and later Mamba / hybrid models). ``pg_collection`` holds the process groups the
    model's modules use (parallel_state's when None)."""

    def __init__(self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None) -> None:
        super().__init__(config)
        self.pg_collection = pg_collection

    # Construction shared by GPTModel and HybridModel. A subclass calls these in this order: the settings
    # (checked before any module is built), the embedding, its rotary embedding, its own decoder, then the
    # output layer. The attribute names are the checkpoint's keys.

    def _init_language_model_settings(
        self,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool,
        post_process: bool,
        fp16_lm_cross_entropy: bool,
        parallel_output: bool,
        share_embeddings_and_output_weights: bool,
        position_embedding_type: str,
        vp_stage: Optional[int],
    ) -> None:
        """Refuse unset sizes and a vocabulary TP cannot split, then keep the settings every language model has."""
        require_model_sizes(self.config, type(self).__name__)
        # The group the vocabulary (output layer and loss) is split over, as Megatron's LanguageModule.tp_group.
        self.tp_group = tp_group_or_default(self.pg_collection)
        tp_size = self.tp_group.size()
        if vocab_size % tp_size != 0:
            raise ValueError(
                f"vocab_size ({vocab_size}) must be divisible by the tensor-parallel size ({tp_size}); pad it as "
                "Megatron does with --make-vocab-size-divisible-by"
            )
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.vp_stage = vp_stage

    def _build_embedding(self, position_embedding_type: str, scatter_to_sequence_parallel: bool) -> None:
        """The word (and learned position) embedding, on the first stage only. Stream 0 of the layout-independent
        init, so its weights do not depend on TP/PP."""
        if not self.pre_process:
            return
        with layout_independent_init(self.config, stream_offset=0):
            self.embedding = LanguageModelEmbedding(
                config=self.config,
                vocab_size=self.vocab_size,
                max_sequence_length=self.max_sequence_length,
                position_embedding_type=position_embedding_type,
                scatter_to_sequence_parallel=scatter_to_sequence_parallel,
                tp_group=self.tp_group,
            )

    def _build_rotary_embedding(
        self,
        rotary_percent: float,
        rotary_base: int,
        seq_len_interpolation_factor: Optional[float],
        **rotary_kwargs,
    ) -> None:
        """``self.rotary_pos_emb`` for 'rope' positions; ``rotary_kwargs`` are RotaryEmbedding's optional ones
        (Llama-3 scaling, the CP group) a model passes on."""
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=self.config.kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=self.config.rotary_interleaved,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            rotary_base=rotary_base,
            use_cpu_initialization=self.config.use_cpu_initialization,
            **rotary_kwargs,
        )

    def _build_output_layer(self) -> None:
        """The vocab-parallel output layer on the last stage, then the embedding tying. Its init stream follows
        every layer's (num_layers + 1); with tied weights on a single stage it has no weight of its own."""
        if self.post_process:
            with layout_independent_init(self.config, stream_offset=self.config.num_layers + 1):
                self.output_layer = tensor_parallel.ColumnParallelLinear(
                    self.config.hidden_size,
                    self.vocab_size,
                    config=self.config,
                    init_method=self.config.init_method,
                    bias=False,
                    skip_bias_add=False,
                    gather_output=not self.parallel_output,
                    skip_weight_param_allocation=self.pre_process and self.share_embeddings_and_output_weights,
                    tp_group=self.tp_group,
                )
        if self.pre_process or self.post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """Hand the previous pipeline stage's output to the decoder (the schedules pass a one-element list)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"{type(self).__name__} takes one input tensor per stage, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy: ``labels [b, s]``, vocab-parallel ``logits [s, b, v/tp]`` -> loss ``[b, s]``."""
        labels = labels.transpose(0, 1).contiguous()
        # The cross entropy computes in fp32 whatever the logits' dtype, so fp16_lm_cross_entropy changes nothing
        # here (as in Megatron-Core 0.19).
        if self.config.cross_entropy_loss_fusion:
            if self.config.cross_entropy_fusion_impl == "te":
                fallback_notice(
                    "cross_entropy_loss_fusion",
                    "--cross-entropy-fusion-impl te needs Transformer Engine, which this build does not use; running "
                    "the native fused cross entropy (pass --cross-entropy-fusion-impl native to silence this)",
                )
            loss = fused_vocab_parallel_cross_entropy(logits, labels, self.tp_group)
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels, tp_group=self.tp_group)
        return loss.transpose(0, 1).contiguous()

    def setup_embeddings_and_output_layer(self) -> None:
        """Tie the output layer to the word embedding when ``share_embeddings_and_output_weights``.

        On a single stage the output layer simply reuses the embedding weight. Across pipeline stages the last stage
        holds its own copy: it starts at zero and is all-reduced over the embedding group, so it equals the first
        stage's embedding; afterwards their gradients are all-reduced over the same group to keep them in sync.
        """
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if not self.share_embeddings_and_output_weights:
            return
        if self.pre_process and self.post_process:
            self.shared_embedding_or_output_weight().shared_embedding = True
            return
        if self.post_process and not self.pre_process:
            weight = self.output_layer.weight
            weight.data.fill_(0)
            weight.shared = True
            weight.shared_embedding = True
        if self.pre_process:
            self.shared_embedding_or_output_weight().shared_embedding = True
        if torch.distributed.is_initialized() and parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
            weight = self.shared_embedding_or_output_weight()
            embedding_group = getattr(self.pg_collection, "embd", None) or parallel_state.get_embedding_group()
            torch.distributed.all_reduce(weight.data, group=embedding_group)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight on the first stage, the output-layer weight on the last."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def _rotary_embedding(self, inference_context, decoder_input, packed_seq_params) -> torch.Tensor:
        """RoPE frequencies for the sequence the decoder sees (the whole sequence, a CP rank's chunks, or the
        inference context's length)."""
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(
            inference_context, self.decoder, decoder_input, self.config, packed_seq_params
        )
        return self.rotary_pos_emb(seq_len, packed_seq=packed_seq_params is not None)

    def _decoder_rotary_pos_emb(self, position_ids, inference_context, decoder_input, packed_seq_params):
        """The rotary angles the decoder's attention applies: RoPE's, or None for other position kinds."""
        if self.position_embedding_type == "rope":
            return self._rotary_embedding(inference_context, decoder_input, packed_seq_params)
        return None

    def _language_model_forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        decoder_input,
        labels,
        inference_context,
        packed_seq_params,
        padding_mask,
        runtime_gather_output,
        extra_block_kwargs=None,
    ) -> torch.Tensor:
        """The forward both models share: embedding (first stage), rotary angles, decoder, then the head (last
        stage); a middle stage returns its hidden states ``[s, b, h]``."""
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary_pos_emb = self._decoder_rotary_pos_emb(position_ids, inference_context, decoder_input, packed_seq_params)
        hidden_states = self.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
            **(extra_block_kwargs or {}),
        )
        if not self.post_process:
            return hidden_states
        return self._logits_or_loss(hidden_states, labels, runtime_gather_output)

    def _logits_or_loss(self, hidden_states, labels, runtime_gather_output) -> torch.Tensor:
        """The last stage's head: logits ``[b, s, v/tp]`` without labels, else the per-token loss ``[b, s]``."""
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v]
        return self.compute_language_model_loss(labels, logits)

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: Tuple[Tuple[int, int, int]] = (),
        metadata: Optional[dict] = None,
    ) -> Dict[str, Any]:
        """The default sharded state, with the output layer's weight stored once when it is tied to the embedding.

        On a last stage that does not also hold the embedding, the output weight is a copy of the first stage's
        word embedding: it is saved under the embedding's key as a non-main replica (pipeline coordinate 1), so it
        is never written but is loaded from the embedding. An untied output layer may load a checkpoint whose
        (padded) vocabulary size differs, like the embedding.
        """
        if sharded_offsets:
            raise ValueError(
                f"{type(self).__name__}.sharded_state_dict got sharded_offsets={sharded_offsets!r}; a whole model "
                "is called without offsets"
            )
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        embedding_key = f"{prefix}embedding.word_embeddings.weight"
        output_weight_key = f"{prefix}output_layer.weight"
        if self.share_embeddings_and_output_weights:
            self.tie_embeddings_and_output_weights_state_dict(
                sharded_state_dict, output_weight_key, embedding_key, metadata or {}
            )
        elif self.post_process:
            sharded_state_dict[output_weight_key].allow_shape_mismatch = True
        return sharded_state_dict

    def tie_embeddings_and_output_weights_state_dict(
        self,
        sharded_state_dict: Dict[str, Any],
        output_layer_weight_key: str,
        first_stage_word_emb_key: str,
        metadata: dict = {},  # noqa: B006  (Megatron's signature; only read)
    ) -> None:
        """Point a last stage's copy of the tied weight at the first stage's embedding key (see above), in place.
        ``metadata['dp_cp_group']``, when given, is the data-parallel group the replica id counts in."""
        if not self.post_process or self.pre_process:
            return  # no output layer here, or it uses the embedding weight itself (not in the state dict)
        dp_cp_group = metadata.get("dp_cp_group")
        dp_rank = (
            dp_cp_group.rank()
            if dp_cp_group is not None
            else parallel_state.get_data_parallel_rank(with_context_parallel=True)
        )
        replica_id = (1, 0, dp_rank)
        sharded_state_dict[output_layer_weight_key] = make_tp_sharded_tensor_for_checkpoint(
            self.shared_embedding_or_output_weight(),
            first_stage_word_emb_key,
            replica_id=replica_id,
            allow_shape_mismatch=True,
            tp_group=self.output_layer.tp_group,
        )
