"""Word (+ learned position) embeddings feeding the transformer, in the ``[s, b, h]`` layout."""

from typing import Literal, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.parallel_state import tp_group_or_default
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device

_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


class LanguageModelEmbedding(MegatronModule):
    """Vocab-parallel word embeddings, optional learned absolute positions and token types, then dropout.

    Output ``[s, b, h]``; under sequence parallelism ``[s/tp, b, h]`` (reduce-scattered straight from the
    vocab-parallel lookup when there is nothing to add to the word embeddings).
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__(config)
        if position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type={position_embedding_type!r} is not valid; "
                f"use one of {_POSITION_EMBEDDING_TYPES}"
            )
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = num_tokentypes
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        self.update_reduce_scatter_embeddings()
        self.tp_group = tp_group if tp_group is not None else tp_group_or_default(None)
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=vocab_size,
            embedding_dim=config.hidden_size,
            init_method=config.embedding_init_method,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            config=config,
            tp_group=self.tp_group,
        )
        if self.add_position_embedding:
            self.position_embeddings = self._replicated_embedding(max_sequence_length)
        if num_tokentypes > 0:
            self.tokentype_embeddings = self._replicated_embedding(num_tokentypes)
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def update_reduce_scatter_embeddings(self) -> None:
        """Reduce-scatter straight from the vocab-parallel lookup when there is nothing to add to the word
        embeddings; re-derived when sequence parallelism is switched (``set_model_to_sequence_parallel``)."""
        self.reduce_scatter_embeddings = (
            not self.add_position_embedding
            and self.num_tokentypes <= 0
            and self.config.sequence_parallel
            and self.scatter_to_sequence_parallel
        )
        if hasattr(self, "word_embeddings"):
            self.word_embeddings.reduce_scatter_embeddings = self.reduce_scatter_embeddings

    def zero_parameters(self):
        """Zero every embedding weight and mark it ``shared``: the weights of a copy whose values come from
        elsewhere (e.g. a checkpoint or an all-reduce), which the optimizer must not count twice."""
        for embedding in (
            self.word_embeddings,
            getattr(self, "position_embeddings", None),
            getattr(self, "tokentype_embeddings", None),
        ):
            if embedding is not None:
                embedding.weight.data.fill_(0)
                embedding.weight.shared = True

    def _replicated_embedding(self, rows: int) -> torch.nn.Embedding:
        device = "cpu" if self.config.use_cpu_initialization else None
        embedding = torch.nn.Embedding(rows, self.config.hidden_size, dtype=self.config.params_dtype, device=device)
        if self.config.perform_initialization:
            self.config.embedding_init_method(embedding.weight)
        # No sequence_parallel mark: the lookup runs on the full sequence before the scatter, whose backward
        # all-gathers, so every rank gets the whole gradient.
        return embedding.to(get_current_device())

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids: int = None) -> torch.Tensor:
        """``[b, s]`` token ids (and positions, token types) -> embeddings ``[s, b, h]`` (``[s/tp, b, h]`` under
        sequence parallelism)."""
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids is None:
                raise ValueError("position_ids are required with learned_absolute position embeddings")
            embeddings = embeddings + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:
            embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if tokentype_ids is not None:
            if self.num_tokentypes <= 0:
                raise ValueError("tokentype_ids given but the embedding was built with num_tokentypes=0")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids).transpose(0, 1)
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if self.config.sequence_parallel:
            if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, group=self.tp_group)
            # Each rank holds a different slice of the sequence: draw its dropout mask from its own stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.embedding_dropout(embeddings)
        return self.embedding_dropout(embeddings)
