"""Small models and a training loop shared by the DDP and optimizer tests.

``TinyLM`` is a pipeline-splittable language model built from plain torch layers whose weights depend only on the
seed and the global layer index, so a stage of it holds exactly the corresponding weights of the full model. With
``tie=True`` the last stage's output layer is a copy of the first stage's embedding, kept in sync by
``finalize_model_grads`` as in GPTModel.
"""

import contextlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, HIDDEN, SEQ = 32, 16, 4


def model_config(**overrides) -> TransformerConfig:
    """The TransformerConfig DDP needs (only its precision and per-token-loss fields matter for TinyLM)."""
    return TransformerConfig(**{"num_layers": 2, "hidden_size": HIDDEN, "num_attention_heads": 2, **overrides})


class TinyLM(torch.nn.Module):
    """Embedding -> ``num_layers`` x (Linear + tanh) -> LayerNorm -> output layer; a pipeline stage holds a slice."""

    def __init__(
        self, num_layers=4, first_layer=0, last_layer=None, pre_process=True, post_process=True, tie=False, seed=1234
    ):
        super().__init__()
        last_layer = num_layers if last_layer is None else last_layer
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = tie
        generator = torch.Generator().manual_seed(seed)
        embedding = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5
        layers = [
            (torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5, torch.randn(HIDDEN, generator=generator))
            for _ in range(num_layers)
        ]
        output = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5
        if pre_process:
            self.embedding = torch.nn.Embedding(VOCAB, HIDDEN, _weight=embedding.clone())
            self.embedding.weight.is_embedding_or_output_parameter = True
        self.layers = torch.nn.ModuleList()
        for weight, bias in layers[first_layer:last_layer]:
            layer = torch.nn.Linear(HIDDEN, HIDDEN)
            layer.weight.data.copy_(weight)
            layer.bias.data.copy_(bias)
            self.layers.append(layer)
        self.input_tensor = None
        if post_process:
            self.norm = torch.nn.LayerNorm(HIDDEN)
            if not (tie and pre_process):
                # An untied output layer, or the last stage's copy of the tied embedding.
                self.output = torch.nn.Parameter(embedding.clone() if tie else output.clone())
                self.output.is_embedding_or_output_parameter = True
                if tie:
                    self.output.shared = True
                    self.output.shared_embedding = True
        if tie and pre_process:
            self.embedding.weight.shared_embedding = True

    def shared_embedding_or_output_weight(self):
        return self.embedding.weight if self.pre_process else self.output

    def set_input_tensor(self, tensor):
        """Take the previous stage's activations (the pipeline schedules pass a one-element list)."""
        self.input_tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor

    def forward(self, tokens, labels=None):
        """``tokens``/``labels`` are ``[b, s]``; activations between stages are ``[s, b, h]`` as in Megatron."""
        hidden = self.embedding(tokens.t()) if self.pre_process else self.input_tensor
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        if not self.post_process:
            return hidden
        tied_here = self.share_embeddings_and_output_weights and self.pre_process
        weight = self.embedding.weight if tied_here else self.output
        logits = F.linear(self.norm(hidden), weight)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.t().reshape(-1))


def make_batch(global_batch: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (global_batch, SEQ), generator=generator)
    return tokens, labels


def train_reference(
    model: torch.nn.Module, opt_config: OptimizerConfig, steps: int, global_batch: int, num_microbatches: int
) -> List[Optional[float]]:
    """Single-process training on the whole global batch; returns the gradient norm of every step."""
    optimizer = get_megatron_optimizer(opt_config, [model])
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        tokens, labels = make_batch(global_batch, seed=step)
        for tok, lab in zip(tokens.chunk(num_microbatches), labels.chunk(num_microbatches)):
            (model(tok, lab) / num_microbatches).backward()
        _, grad_norm, _ = optimizer.step()
        norms.append(grad_norm)
    return norms


def wrap(model, ddp_config: DistributedDataParallelConfig, config: Optional[TransformerConfig] = None):
    return DistributedDataParallel(config or model_config(), ddp_config, model)


def train_data_parallel(
    ddp_model, optimizer, steps: int, global_batch: int, num_microbatches: int, inject=None
) -> List[Optional[float]]:
    """Each DP rank trains on its slice of every global batch (loss scaled by the optimizer's loss scale); returns
    the gradient norm of every step (None for a skipped step). ``inject(step, loss)`` may replace a loss."""
    dp_rank = dist.get_rank(ddp_model.dp_cp_group)
    dp_size = dist.get_world_size(ddp_model.dp_cp_group)
    norms = []
    for step in range(steps):
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, labels = make_batch(global_batch, seed=step)
        tokens, labels = tokens.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
        micro = list(zip(tokens.chunk(num_microbatches), labels.chunk(num_microbatches)))
        for index, (tok, lab) in enumerate(micro):
            last = index == len(micro) - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                loss = ddp_model(tok, lab) / num_microbatches
                if inject is not None:
                    loss = inject(step, loss)
                optimizer.scale_loss(loss).backward()
        finalize_model_grads([ddp_model])
        _, grad_norm, _ = optimizer.step()
        norms.append(grad_norm)
    return norms


def weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {name: param.detach().float().clone() for name, param in model.named_parameters()}


def max_relative_error(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, value in actual.items():
        reference = expected[name]
        worst = max(worst, ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item())
    return worst
