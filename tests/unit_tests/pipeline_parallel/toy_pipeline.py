"""A tiny residual MLP split into pipeline stages, for testing the schedules without the GPT model.

Layer ``i`` computes ``x + tanh(W_i x + b_i)`` on ``[s, b, h]`` activations. The full model's layers come from a
fixed seed, so every rank can build its own chunks (by global layer index, using the same layout functions as
``TransformerBlock``) with exactly the weights of the single-stage reference. The last stage's loss is the masked
squared error against a target. Every forward pass and every backward pass records ``('F'|'B', microbatch_id,
model_chunk_id)`` in ``TRACE``, in the order the schedule runs them.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import get_num_layers_to_build, get_transformer_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN = 8
TRACE = []


def toy_config(num_layers: int, pp: int = 1, vp=None, **overrides) -> TransformerConfig:
    fields = dict(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32,
    )
    return TransformerConfig(**{**fields, **overrides})


def full_layers(num_layers: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        layer = torch.nn.Linear(HIDDEN, HIDDEN)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5)
            layer.bias.copy_(torch.randn(HIDDEN, generator=generator) * 0.1)
        layers.append(layer)
    return layers


class _RecordBackward(torch.autograd.Function):
    """Copy whose backward notes which (micro-batch, chunk) starts being backpropagated."""

    @staticmethod
    def forward(ctx, x, microbatch, chunk):
        ctx.key = (microbatch, chunk)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        TRACE.append(("B", *ctx.key))
        return grad, None, None


class ToyChunk(torch.nn.Module):
    """One model chunk: the layers ``first_layer .. first_layer + len(layers) - 1`` of the toy model."""

    def __init__(self, config, layers, first_layer: int, pre_process: bool, post_process: bool, chunk: int = 0):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(layers)
        self.first_layer = first_layer
        self.pre_process = pre_process
        self.post_process = post_process
        self.chunk = chunk
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x, microbatch: int):
        if not self.pre_process:
            x = self.input_tensor
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return _RecordBackward.apply(x, microbatch, self.chunk)

    def global_grads(self):
        return {
            self.first_layer + i: (layer.weight.grad.clone(), layer.bias.grad.clone())
            for i, layer in enumerate(self.layers)
        }


def build_chunks(config, seed: int = 0):
    """This rank's model chunks (a list, one per virtual stage), cut from the seeded full model."""
    layers = full_layers(config.num_layers, seed)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    vp_size = config.virtual_pipeline_model_parallel_size
    chunks = []
    for chunk in range(vp_size or 1):
        vp_stage = chunk if vp_size else None
        offset = get_transformer_layer_offset(config, vp_stage)
        count = get_num_layers_to_build(config, vp_stage)
        first = pp_rank == 0 and chunk == 0
        last = pp_rank == pp_size - 1 and chunk == (vp_size or 1) - 1
        chunks.append(ToyChunk(config, layers[offset : offset + count], offset, first, last, chunk))
    return chunks


def make_microbatches(num_microbatches: int, seq_lengths=None, micro_batch_size: int = 2, seed: int = 1):
    """Inputs, targets and loss masks; ``seq_lengths`` gives each micro-batch its own sequence length."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for mb in range(num_microbatches):
        seq = 4 if seq_lengths is None else seq_lengths[mb]
        batches.append(
            {
                "id": mb,
                "x": torch.randn(seq, micro_batch_size, HIDDEN, generator=generator),
                "target": torch.randn(seq, micro_batch_size, HIDDEN, generator=generator),
                "mask": (torch.rand(seq, micro_batch_size, generator=generator) > 0.3).float(),
            }
        )
    return batches


def forward_step_func(legacy_loss: bool = False, record_output=None):
    """A Megatron-style forward step: every stage reads the micro-batch; the last one computes the loss."""

    def step(data_iterator, model):
        batch = next(data_iterator)
        TRACE.append(("F", batch["id"], model.chunk))
        output = model(batch["x"], batch["id"])
        if record_output is not None:
            record_output.append(output)

        def loss_func(output_tensor, non_loss_data=False):
            if non_loss_data:
                return {"mean output": output_tensor.detach().mean()}
            per_token = ((output_tensor - batch["target"]) ** 2).sum(-1) * batch["mask"]
            num_tokens = batch["mask"].sum().to(torch.int64)
            if legacy_loss:
                mean = per_token.sum() / num_tokens
                return mean, {"loss": mean.detach()}
            return per_token.sum(), num_tokens, {"loss": torch.stack([per_token.sum().detach(), num_tokens])}

        return output, loss_func

    return step


def iterators(batches, num_chunks: int):
    return [iter(batches) for _ in range(num_chunks)]


def gather_grads(chunks) -> dict:
    """Every layer's gradients from every pipeline rank, keyed by global layer index (on all ranks)."""
    mine = {}
    for chunk in chunks:
        mine.update(chunk.global_grads())
    everyone = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(everyone, mine, group=parallel_state.get_pipeline_model_parallel_group())
    merged = {}
    for grads in everyone:
        merged.update(grads)
    return merged
