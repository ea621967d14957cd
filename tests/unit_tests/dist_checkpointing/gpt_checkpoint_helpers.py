"""A small GPT at any TP/PP/VPP/DP layout, trained with Megatron's optimizers, and its checkpoint state dicts.

Used by the resharding tests: a layout's model chunks (DDP-wrapped) and optimizer, a few training steps through the
pipeline schedules on a fixed global batch, the full (TP-gathered, globally named) weights, and the state dict the
training application saves: ``model`` / ``model0, model1, ...`` plus ``optimizer``.
"""

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories, is_main_replica
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.unit_tests.models.gpt_test_helpers import BATCH, SEQ, VARIANTS, VOCAB, build_config, gather_tensor_parallel
from tests.unit_tests.pipeline_parallel.gpt_pipeline_helpers import forward_step, global_name
from tests.unit_tests.test_utilities import Utils

NUM_LAYERS = 4
GLOBAL_MICROBATCHES = 4  # split over the data-parallel ranks

# SwiGLU (with biases, so fc1's bias goes through the gate/up factory too), RMSNorm, grouped-query attention, rotary
# positions and tied embeddings: every special case of the checkpoint layout in one model.
CHECKPOINT_VARIANT = {**VARIANTS["llama"]["config"], "add_bias_linear": True}
CHECKPOINT_MODEL_KWARGS = dict(VARIANTS["llama"]["model"])


def build_chunks(
    tp: int,
    pp: int,
    vp: Optional[int] = None,
    seed: int = 1234,
    distributed_optimizer: bool = False,
    bf16: bool = False,
    variant_config: Optional[dict] = None,
    model_kwargs: Optional[dict] = None,
    transformer_engine_layout: bool = False,
):
    """This rank's DDP-wrapped model chunks and their optimizer (Adam) at TP=tp, PP=pp (VPP=vp), DP=the rest.

    ``variant_config`` / ``model_kwargs`` replace CHECKPOINT_VARIANT / CHECKPOINT_MODEL_KWARGS;
    ``transformer_engine_layout`` builds the Transformer Engine layer spec instead of the local one.
    """
    Utils.initialize_model_parallel(tp, pp, vp)
    model_parallel_cuda_manual_seed(seed)
    overrides = {
        **(CHECKPOINT_VARIANT if variant_config is None else variant_config),
        "num_layers": NUM_LAYERS,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vp,
        "pipeline_dtype": torch.bfloat16 if bf16 else torch.float32,
        "finalize_model_grads_func": finalize_model_grads,
        "bf16": bf16,
    }
    config = build_config(tp, False, overrides)
    if transformer_engine_layout:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=3000 if distributed_optimizer else None,  # several buckets, shards cutting through parameters
    )
    chunks = []
    for chunk in range(vp or 1):
        model = GPTModel(
            config,
            spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=pp_rank == 0 and chunk == 0,
            post_process=pp_rank == pp - 1 and chunk == (vp or 1) - 1,
            vp_stage=chunk if vp else None,
            **(CHECKPOINT_MODEL_KWARGS if model_kwargs is None else model_kwargs),
        )
        if bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        chunks.append(DistributedDataParallel(config, ddp_config, model))
    optimizer_config = OptimizerConfig(
        lr=1e-2, weight_decay=0.1, bf16=bf16, use_distributed_optimizer=distributed_optimizer
    )
    optimizer = get_megatron_optimizer(optimizer_config, chunks)
    return chunks, optimizer


def gpt_model(chunk) -> GPTModel:
    """The GPTModel inside a DDP (and Float16Module) wrapper."""
    while not isinstance(chunk, GPTModel):
        chunk = chunk.module
    return chunk


def _global_microbatches(step: int):
    generator = torch.Generator().manual_seed(1000 + step)
    batches = []
    for _ in range(GLOBAL_MICROBATCHES):
        batches.append(
            {
                "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
                "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
                "loss_mask": (torch.rand(BATCH, SEQ, generator=generator) > 0.2).float(),
                "position_ids": torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ),
            }
        )
    return batches


def train(chunks, optimizer, steps: List[int]) -> List[Optional[float]]:
    """One optimizer step per entry of ``steps`` (the step number picks the global batch); returns each step's
    loss per token over the global batch on the last pipeline stage, None elsewhere."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    losses = []
    for step in steps:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        per_rank = GLOBAL_MICROBATCHES // dp_size
        batches = _global_microbatches(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=per_rank,
            seq_length=SEQ,
            micro_batch_size=BATCH,
        )
        update_successful, _, _ = optimizer.step()
        assert update_successful
        if reduced:
            totals = torch.stack([item["lm loss"] for item in reduced]).sum(dim=0)
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
            losses.append((totals[0] / totals[1]).item())
        else:
            losses.append(None)
    for chunk in chunks:
        chunk.state_dict()  # completes a pending parameter all-gather
    return losses


def full_weights(chunks) -> Dict[str, torch.Tensor]:
    """This rank's parameters as whole (TP-gathered) fp32 tensors under the single-stage model's names; a last
    stage's copy of the tied embedding is left out (see tied_copy_matches_embedding)."""
    weights = {}
    for chunk in chunks:
        model = gpt_model(chunk)
        for name, param in model.named_parameters():
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                continue
            weights[global_name(name, model)] = gather_tensor_parallel(param.detach().float().clone(), param)
    return weights


def tied_copy_matches_embedding(chunks) -> bool:
    """Whether the first stage's word embedding equals the last stage's output weight (True off those stages)."""
    group = parallel_state.get_embedding_group()
    if group is None or dist.get_world_size(group) == 1:
        return True
    models = [gpt_model(chunk) for chunk in chunks]
    owner = models[0] if models[0].pre_process else models[-1]
    weight = owner.shared_embedding_or_output_weight().detach()
    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, weight.contiguous(), group=group)
    return all(torch.equal(copy, copies[0]) for copy in copies)


def checkpoint_state_dict(chunks, optimizer=None, is_loading: bool = False) -> dict:
    """The sharded state dict the training application saves: ``model`` (one chunk) or ``model0, model1, ...``,
    then ``optimizer`` keyed by the model's parameters."""
    if len(chunks) == 1:
        state_dict = {"model": chunks[0].sharded_state_dict()}
    else:
        state_dict = {f"model{index}": chunk.sharded_state_dict() for index, chunk in enumerate(chunks)}
    if optimizer is not None:
        state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, is_loading=is_loading)
    return state_dict


def load_into(chunks, optimizer, loaded: dict) -> None:
    """Put a loaded checkpoint state dict into the model chunks and the optimizer."""
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"])
    else:
        for index, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{index}"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])


def describe_pieces(sharded_state_dict: dict) -> List[tuple]:
    """Every piece of a (model) sharded state dict, factories built: (kind, key, global shape, global offset, local
    shape, main replica?) -- picklable, for checking a layout's pieces in the test process."""
    sharded_state_dict = dict(sharded_state_dict)
    apply_factories(sharded_state_dict)
    pieces = []
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensor):
            pieces.append(
                (
                    "tensor",
                    item.key,
                    item.global_shape,
                    item.global_offset,
                    item.local_shape,
                    is_main_replica(item.replica_id),
                )
            )
        elif isinstance(item, ShardedObject):
            pieces.append(
                ("object", item.key, item.global_shape, item.global_offset, None, is_main_replica(item.replica_id))
            )
    return pieces
