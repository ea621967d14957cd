"""Build a small GPT split over pipeline stages (and model chunks) with the exact weights of the single-stage model.

Every rank first builds the whole model (pipeline size 1, this rank's tensor-parallel shard) from the shared seed,
then builds its own stages and copies the matching weights in: a stage's local layer ``i`` is global layer
``offset + i``. The tied output layer of the last stage is checked against the first stage's embedding before it is
overwritten, so the embedding group's initial all-reduce is exercised too.
"""

import re

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_block import get_transformer_layer_offset
from tests.unit_tests.models.gpt_test_helpers import BATCH, SEQ, VARIANTS, VOCAB, build_config, gather_tensor_parallel

SEED = 1234
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def microbatches(num_microbatches: int, seq_lengths=None, seed: int = 7):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for mb in range(num_microbatches):
        seq = SEQ if seq_lengths is None else seq_lengths[mb]
        batches.append(
            {
                "tokens": torch.randint(0, VOCAB, (BATCH, seq), generator=generator),
                "labels": torch.randint(0, VOCAB, (BATCH, seq), generator=generator),
                "loss_mask": (torch.rand(BATCH, seq, generator=generator) > 0.2).float(),
                "position_ids": torch.arange(seq).unsqueeze(0).expand(BATCH, seq),
            }
        )
    return batches


def forward_step(data_iterator, model):
    """pretrain_gpt-style step: per-token loss summed over unmasked tokens, with the token count."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"]
        loss = (output_tensor.float() * mask).sum()
        num_tokens = mask.sum().to(torch.int64)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    return output, loss_func


def _model_kwargs(variant: str) -> dict:
    return dict(VARIANTS[variant]["model"])


def build_full_model(tp: int, sp: bool, variant: str, num_layers: int) -> GPTModel:
    """The single-stage model at this TP size (identical full weights for every TP size, from the seed)."""
    model_parallel_cuda_manual_seed(SEED)
    config = build_config(tp, sp, {**VARIANTS[variant]["config"], "num_layers": num_layers})
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, **_model_kwargs(variant))


def build_stage_chunks(tp, sp, variant, num_layers, pp, vp=None, **layout):
    """This rank's model chunks for the layout, plus the config they share."""
    overrides = {
        **VARIANTS[variant]["config"],
        "num_layers": num_layers,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vp,
        "pipeline_dtype": torch.float32,
        "finalize_model_grads_func": finalize_model_grads,
        **layout,
    }
    config = build_config(tp, sp, overrides)
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for chunk in range(vp or 1):
        chunks.append(
            GPTModel(
                config,
                spec,
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                pre_process=pp_rank == 0 and chunk == 0,
                post_process=pp_rank == pp - 1 and chunk == (vp or 1) - 1,
                vp_stage=chunk if vp else None,
                **_model_kwargs(variant),
            )
        )
    return chunks, config


def global_name(name: str, chunk: GPTModel) -> str:
    """The single-stage model's name for a stage parameter (the tied output weight is the embedding)."""
    match = _LAYER.match(name)
    if match:
        offset = get_transformer_layer_offset(chunk.config, chunk.vp_stage)
        return f"decoder.layers.{offset + int(match.group(1))}." + name[match.end() :]
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return name


def copy_weights(full: GPTModel, chunks) -> None:
    weights = dict(full.named_parameters())
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                param.copy_(weights[global_name(name, chunk)])


def tied_weights_match(chunks) -> bool:
    """Whether the first stage's embedding equals the last stage's output weight (True off those stages)."""
    group = parallel_state.get_embedding_group()
    if group is None or dist.get_world_size(group) == 1:
        return True
    owner = chunks[0] if chunks[0].pre_process else chunks[-1]
    weight = owner.shared_embedding_or_output_weight().detach()
    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, weight.contiguous(), group=group)
    return all(torch.equal(copy, copies[0]) for copy in copies)


def stage_gradients(chunks) -> dict:
    """This rank's gradients as full (TP-gathered) tensors under their single-stage names.

    The tied output weight is left out: after finalize_model_grads it equals the embedding's gradient, which the
    first stage reports.
    """
    grads = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
                continue
            grads[global_name(name, chunk)] = gather_tensor_parallel(param.grad.detach().clone(), param)
    return grads


def run_schedule(chunks, batches, num_microbatches, forward_only=False, seq_length=SEQ):
    """One step of whichever schedule parallel_state's layout calls for (every chunk reads the same batches)."""
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=BATCH,
        forward_only=forward_only,
    )
