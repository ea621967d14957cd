"""finalize_model_grads: everything that must happen to gradients between the last backward and the optimizer step.

Called once per training step (the pipeline schedules call it through ``config.finalize_model_grads_func``):

1. finish the data-parallel reduction of every model chunk that is wrapped in our ``DistributedDataParallel``;
2. all-reduce the gradients of parameters that are replicated, not split, across tensor-parallel ranks but whose
   gradient each rank holds only part of (norms and row-parallel biases under sequence parallelism, q/k
   layernorms: parameters marked ``sequence_parallel=True``) over the TP group;
3. all-reduce the gradient of the tied word embedding over the embedding group (first and last pipeline stage),
   and of learned absolute position embeddings over the position-embedding group;
4. with aux-loss-free MoE load balancing (``moe_router_enable_expert_bias``), move every router's
   ``expert_bias`` by ``moe_router_bias_update_rate`` towards balance, from this step's token counts summed over
   the TP x DP x CP ranks, then clear the per-step router statistics (:func:`reset_model_temporary_tensors`)
   (quantile balancing, Megatron's other per-batch router update, is not built: ``_update_router_qb_beta``);
5. with per-token loss, divide every gradient by the number of tokens in the global batch.

Expert parameters (``allreduce=False``) are not special-cased here: DDP already reduced them over the
expert-data-parallel group, and none of them is replicated across TP in a way that the all-reduces above touch.

It works on plain modules too (reading ``param.grad``) as well as on DDP-wrapped ones (reading ``param.main_grad``).
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import to_local_if_dtensor


def _get_main_grad_attr(param: torch.nn.Parameter) -> str:
    """Name of the attribute holding the gradient the optimizer reads: DDP's ``main_grad`` if set, else ``grad``."""
    return "main_grad" if getattr(param, "main_grad", None) is not None else "grad"


def _grad_of(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient to reduce: for an FSDP2 (DTensor) parameter this rank's shard, which the TP ranks of one
    DP coordinate hold alike, so reductions over TP or pipeline groups treat it like a whole gradient."""
    grad = getattr(param, _get_main_grad_attr(param))
    with torch.no_grad():
        return to_local_if_dtensor(grad)


def _grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    """Like :func:`_grad_of`, but give a parameter that received no gradient a zero one, so collectives match up."""
    grad = _grad_of(param)
    if grad is None:
        param.grad = torch.zeros_like(param)
        grad = _grad_of(param)
    return grad


def _find_attr(module: torch.nn.Module, attr: str):
    """``module.attr`` looking through wrappers that keep the real model in ``.module``; None if nobody has it."""
    while not hasattr(module, attr) and hasattr(module, "module"):
        module = module.module
    return getattr(module, attr, None)


def _groups(pg_collection: Optional[ProcessGroupCollection]) -> ProcessGroupCollection:
    if pg_collection is not None:
        return pg_collection
    return ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "pp", "embd", "pos_embd", "dp_cp", "tp_dp_cp"]
    )


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce_coalesced(grads: List[torch.Tensor], group: dist.ProcessGroup) -> None:
    """All-reduce several gradients with one collective per dtype (flatten, reduce, copy back)."""
    by_dtype = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same_dtype])
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in same_dtype:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _allreduce_non_tensor_model_parallel_grads(model: List[torch.nn.Module], config, tp_group) -> None:
    """Sum, over the TP group, the gradients of parameters that are not tensor-parallel but whose gradient each TP
    rank only holds a part of (parameters marked ``sequence_parallel=True``). ``config`` is the model's (unused:
    the marking, not the configuration, decides)."""
    del config
    if _group_size(tp_group) == 1:
        return
    grads = [
        _grad_or_zeros(param)
        for chunk in model
        for param in chunk.parameters()
        if param.requires_grad and getattr(param, "sequence_parallel", False)
    ]
    if grads:
        _all_reduce_coalesced(grads, tp_group)


def _embedding_chunk(model: List[torch.nn.Module], pp_group) -> torch.nn.Module:
    """The chunk holding this stage's embedding: the last chunk on the last stage (output layer), else the first."""
    pp_size = _group_size(pp_group)
    pp_rank = dist.get_rank(pp_group) if pp_size > 1 else 0
    return model[-1] if pp_rank == pp_size - 1 else model[0]


def _allreduce_word_embedding_grads(model: List[torch.nn.Module], config, embd_group, pp_group) -> None:
    """Keep the tied input embedding (first stage) and output layer (last stage) equal: sum their gradients over
    the embedding group. ``config`` is the model's (unused: the model says whether its weights are tied)."""
    del config
    if embd_group is None or _group_size(embd_group) == 1:
        return
    chunk = _embedding_chunk(model, pp_group)
    if not _find_attr(chunk, "share_embeddings_and_output_weights"):
        return
    weight = _find_attr(chunk, "shared_embedding_or_output_weight")()
    dist.all_reduce(_grad_or_zeros(weight), group=embd_group)


def _allreduce_position_embedding_grads(model: List[torch.nn.Module], config, pos_emb_group, pp_group) -> None:
    """Keep learned absolute position embeddings equal on every stage of the position-embedding group (several
    stages hold one only when a pipeline starts two embedding sections): sum their gradients. With one stage in
    the group, or no learned position embedding, nothing happens."""
    del config
    if pos_emb_group is None or _group_size(pos_emb_group) == 1:
        return
    embedding = _find_attr(_embedding_chunk(model, pp_group), "embedding")
    position_embeddings = getattr(embedding, "position_embeddings", None)
    if position_embeddings is None:
        return
    dist.all_reduce(_grad_or_zeros(position_embeddings.weight), group=pos_emb_group)


def _update_router_expert_bias(model: List[torch.nn.Module], config, tp_dp_cp_group) -> None:
    """Aux-loss-free load balancing (DeepSeek-V3): every router with an ``expert_bias`` moves it by
    ``config.moe_router_bias_update_rate`` up for under-loaded and down for over-loaded experts.

    All routers of this stage are stacked so that their token counts are summed over the TP x DP x CP group in one
    collective (inside ``get_updated_expert_bias``); :func:`reset_model_temporary_tensors` then zeroes the counts
    for the next step. A stage without
    routers issues no collective (every rank of its TP x DP x CP group is on the same stage, so none waits).
    """
    routers = [
        module for chunk in model for module in chunk.modules() if getattr(module, "expert_bias", None) is not None
    ]
    if not routers:
        return
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    tokens_per_expert = torch.stack([router.local_tokens_per_expert for router in routers])
    expert_bias = torch.stack([router.expert_bias for router in routers])
    updated = get_updated_expert_bias(
        tokens_per_expert, expert_bias, config.moe_router_bias_update_rate, tp_dp_cp_group=tp_dp_cp_group
    )
    with torch.no_grad():
        for router, new_bias in zip(routers, updated):
            router.expert_bias.copy_(new_bias)


def _update_router_qb_beta(
    model: List[torch.nn.Module], config, dp_cp_group: Optional[dist.ProcessGroup] = None
) -> None:
    """Megatron's once-per-batch update of quantile-balancing router biases (``qb_beta``), for
    ``moe_router_load_balancing_type='quantile_balancing'``.

    Quantile balancing is not built here (the config and the router refuse it), so no training module accumulates
    ``qb_beta_accum`` and this is a no-op, as in Megatron when the feature is off. A module that does carry the
    accumulators (someone else's router) is refused rather than left with a bias that silently never moves.
    """
    carriers = [
        name
        for chunk in model
        for name, module in chunk.named_modules()
        if getattr(module, "qb_beta_accum", None) is not None and module.training
    ]
    if carriers:
        raise ValueError(
            f"not supported yet: MoE quantile balancing (modules {carriers[:3]} carry qb_beta_accum); use "
            "moe_router_load_balancing_type 'aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn' or 'none'"
        )


def _scale_grads(chunk: torch.nn.Module, factor: torch.Tensor) -> None:
    if hasattr(chunk, "scale_gradients"):
        chunk.scale_gradients(factor)
        return
    for param in chunk.parameters():
        grad = _grad_of(param)
        if grad is not None:
            grad.mul_(factor)


def _divide_by_num_tokens(model: List[torch.nn.Module], num_tokens: torch.Tensor, groups) -> None:
    """Divide gradients by the global token count: the last stage's count, summed over DP(+CP) ranks."""
    if _group_size(groups.pp) > 1:
        last_stage = dist.get_global_rank(groups.pp, _group_size(groups.pp) - 1)
        dist.broadcast(num_tokens, src=last_stage, group=groups.pp)
    if _group_size(groups.dp_cp) > 1:
        dist.all_reduce(num_tokens, group=groups.dp_cp)
    total = num_tokens.to(torch.float32)
    # An empty global batch leaves the gradients (all zero) as they are instead of filling them with NaN.
    factor = torch.where(total > 0, 1.0 / total.clamp_min(1.0), torch.ones_like(total))
    for chunk in model:
        _scale_grads(chunk, factor)


def finalize_model_grads(
    model: List[torch.nn.Module],
    num_tokens: Optional[torch.Tensor] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    force_all_reduce: Optional[bool] = False,
):
    """Finish this step's gradients for ``model`` (a list of model chunks; one module is accepted too) in place.

    ``num_tokens`` (a tensor holding this rank's token count, used with ``calculate_per_token_loss``) is summed over
    the data-parallel(+context-parallel) ranks of the last pipeline stage, shared with every stage, and every
    gradient is divided by it. ``pg_collection`` names the groups to use (tp, pp, embd, pos_embd, dp_cp); by
    default the ``parallel_state`` groups (``tp_dp_cp`` is used for the MoE expert-bias update).
    ``force_all_reduce`` makes DDP chunks all-reduce their gradients even
    with the distributed optimizer (every rank then holds the full reduced gradient, not just its shard).
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    groups = _groups(pg_collection)
    config = _find_attr(chunks[0], "config")
    _allreduce_non_tensor_model_parallel_grads(chunks, config, groups.tp)
    _allreduce_word_embedding_grads(chunks, config, groups.embd, groups.pp)
    _allreduce_position_embedding_grads(chunks, config, getattr(groups, "pos_embd", None), groups.pp)
    if getattr(config, "moe_router_enable_expert_bias", False):
        _update_router_expert_bias(chunks, config, getattr(groups, "tp_dp_cp", None))
    if getattr(config, "moe_router_load_balancing_type", None) == "quantile_balancing":
        _update_router_qb_beta(chunks, config, dp_cp_group=groups.dp_cp)
    if config is not None:
        reset_model_temporary_tensors(config, chunks)
    if num_tokens is not None:
        if not isinstance(num_tokens, torch.Tensor):
            raise TypeError(
                f"finalize_model_grads: num_tokens must be a tensor (it is reduced across ranks), got "
                f"{type(num_tokens).__name__}; pass torch.tensor(count)"
            )
        _divide_by_num_tokens(chunks, num_tokens, groups)


def reset_model_temporary_tensors(config, model: List[torch.nn.Module]):
    """Clear what routers accumulate over a step, before the next one.

    With ``config.moe_router_enable_expert_bias`` every module with an ``expert_bias`` has its
    ``local_tokens_per_expert`` counts zeroed; with a ``global_aux_loss`` load-balancing type (alone or in a
    comma-separated list) every module with ``reset_global_aux_loss_tracker`` resets its tracker. Models without
    MoE routers are left untouched.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    expert_bias = getattr(config, "moe_router_enable_expert_bias", False)
    global_aux_loss = "global_aux_loss" in (getattr(config, "moe_router_load_balancing_type", "") or "")
    for chunk in chunks:
        for module in chunk.modules():
            if expert_bias and hasattr(module, "expert_bias"):
                module.local_tokens_per_expert.zero_()
            if global_aux_loss and hasattr(module, "reset_global_aux_loss_tracker"):
                module.reset_global_aux_loss_tracker()
