"""LanguageModule: what every language model shares — the LM loss and the tied input/output embedding."""

import logging
from typing import Optional

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule

logger = logging.getLogger(__name__)


class LanguageModule(MegatronModule):
    """Base class of GPTModel (and later Mamba / hybrid models)."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy: ``labels [b, s]``, vocab-parallel ``logits [s, b, v/tp]`` -> loss ``[b, s]``."""
        labels = labels.transpose(0, 1).contiguous()
        if not self.fp16_lm_cross_entropy:
            logits = logits.float()
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
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
        if torch.distributed.is_initialized() and parallel_state.is_rank_in_embedding_group(
            ignore_virtual=True
        ):
            weight = self.shared_embedding_or_output_weight()
            torch.distributed.all_reduce(weight.data, group=parallel_state.get_embedding_group())

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight on the first stage, the output-layer weight on the last."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None
