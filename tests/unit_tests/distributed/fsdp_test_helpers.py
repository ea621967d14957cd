"""Train a tiny GPT under DDP or Megatron FSDP and read back what each rank holds (shared by the FSDP tests)."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.fsdp import FullyShardedDataParallel
from megatron.core.distributed.fsdp.sharded_buffer import ShardedParamAndGradBuffer
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.models import gpt_test_helpers as gpt

GLOBAL_BATCH = 4
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def wrap(model, strategy=None, **ddp_fields):
    """DDP (``strategy`` None) or FSDP with ``strategy``; the sharded strategies use the distributed optimizer."""
    if strategy is None:
        return DistributedDataParallel(model.config, DistributedDataParallelConfig(**ddp_fields), model)
    fields = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
    fields["use_distributed_optimizer"] = strategy != "no_shard"
    fields.update(ddp_fields)
    return FullyShardedDataParallel(model.config, DistributedDataParallelConfig(**fields), model)


def optimizer_for(wrapped, **overrides):
    config = OptimizerConfig(
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.5,
        use_distributed_optimizer=wrapped.ddp_config.use_distributed_optimizer,
        **overrides,
    )
    return get_megatron_optimizer(config, [wrapped])


def batch(step: int, microbatches: int = 1):
    """This DP rank's micro-batches of step ``step``'s global batch."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, gpt.VOCAB, (GLOBAL_BATCH, gpt.SEQ), generator=generator)
    labels = torch.randint(0, gpt.VOCAB, (GLOBAL_BATCH, gpt.SEQ), generator=generator)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    tokens, labels = tokens.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
    positions = torch.arange(gpt.SEQ).expand(tokens.shape[0], gpt.SEQ)
    return list(zip(tokens.chunk(microbatches), positions.chunk(microbatches), labels.chunk(microbatches)))


def train_step(wrapped, optimizer, step: int, microbatches: int = 1, after_grads=None):
    """One step; returns the loss averaged over the global batch (the same number on every layout)."""
    wrapped.zero_grad_buffer()
    optimizer.zero_grad()
    micro = batch(step, microbatches)
    total = torch.zeros(())
    for index, (tokens, positions, labels) in enumerate(micro):
        context = wrapped.no_sync() if index < len(micro) - 1 else _null()
        with context:
            loss = wrapped(tokens, positions, None, labels=labels).mean() / len(micro)
            loss.backward()
        total += loss.detach()
    num_tokens = None
    if wrapped.config.calculate_per_token_loss:
        # Divide the summed gradients by the global token count (finalize_model_grads reduces this rank's count).
        num_tokens = torch.tensor(sum(labels.numel() for _, _, labels in micro), dtype=torch.float32)
    finalize_model_grads([wrapped], num_tokens=num_tokens)
    if after_grads is not None:
        after_grads(wrapped)
    optimizer.step()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return total.item() / parallel_state.get_data_parallel_world_size()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def reduced_gradients(wrapped) -> dict:
    """Every parameter's DP-reduced gradient, whole (TP shards stay shards), from whatever each rank keeps."""
    grads = {}
    name_of = {param: name for name, param in wrapped.module.named_parameters()}
    for buffer in wrapped.buffers + wrapped.expert_parallel_buffers:
        group, world = buffer.data_parallel_group, buffer.data_parallel_world_size
        if isinstance(buffer, ShardedParamAndGradBuffer):
            local = buffer.grad_shard
        elif wrapped.ddp_config.use_distributed_optimizer:
            rank = dist.get_rank(group)
            local = buffer.grad_data[rank * (buffer.numel // world) : (rank + 1) * (buffer.numel // world)]
        else:
            local = None
        if local is not None:
            whole = torch.empty(buffer.numel, dtype=local.dtype)
            dist.all_gather_into_tensor(whole, local.contiguous(), group=group)
        for param, (start, end, _) in buffer.param_index_map.items():
            value = param.main_grad if local is None else whole[start:end].view(param.shape)
            grads[name_of[param]] = value.detach().float().clone()
    return grads


def full_weights(wrapped) -> dict:
    """Every parameter, whole (FSDP gathers its shards first)."""
    if isinstance(wrapped, FullyShardedDataParallel):
        wrapped.gather_all_params()
    wrapped.free_overlap_buffers()
    return {name: param.detach().float().clone() for name, param in wrapped.module.named_parameters()}
