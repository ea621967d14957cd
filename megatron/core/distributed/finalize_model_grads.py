"""finalize_model_grads: everything that must happen to gradients between the last backward and the optimizer step.

Called once per training step (the pipeline schedules call it through ``config.finalize_model_grads_func``):

1. finish the data-parallel reduction of every model chunk that is wrapped in our ``DistributedDataParallel``;
2. all-reduce the gradients of parameters whose gradient is partial across tensor-parallel ranks (norms and
   row-parallel biases under sequence parallelism, q/k layernorms) over the TP group;
3. all-reduce the gradient of the tied word embedding over the embedding group (first and last pipeline stage);
4. with per-token loss, divide every gradient by the number of tokens in the global batch.

It works on plain modules too (reading ``param.grad``) as well as on DDP-wrapped ones (reading ``param.main_grad``).
"""

from typing import List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection


def _grad_of(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient the optimizer will read: DDP's ``main_grad`` when present, else ``.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    """Like :func:`_grad_of`, but give a parameter that received no gradient a zero one, so collectives match up."""
    grad = _grad_of(param)
    if grad is None:
        param.grad = torch.zeros_like(param)
        grad = param.grad
    return grad


def _find_attr(module: torch.nn.Module, attr: str):
    """``module.attr`` looking through wrappers that keep the real model in ``.module``; None if nobody has it."""
    while not hasattr(module, attr) and hasattr(module, "module"):
        module = module.module
    return getattr(module, attr, None)


def _groups(pg_collection: Optional[ProcessGroupCollection]) -> ProcessGroupCollection:
    if pg_collection is not None:
        return pg_collection
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "embd", "dp_cp"])


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


def _allreduce_tensor_parallel_partial_grads(model: List[torch.nn.Module], tp_group) -> None:
    """Sum gradients that each TP rank only holds a part of (params marked ``sequence_parallel=True``)."""
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


def _allreduce_word_embedding_grads(model: List[torch.nn.Module], groups: ProcessGroupCollection) -> None:
    """Keep the tied input embedding (first stage) and output layer (last stage) equal: sum their gradients."""
    embd_group = groups.embd
    if embd_group is None or _group_size(embd_group) == 1:
        return
    pp_size = _group_size(groups.pp)
    pp_rank = dist.get_rank(groups.pp) if pp_size > 1 else 0
    # The first stage holds the embedding in its first chunk, the last stage the output layer in its last chunk.
    chunk = model[-1] if pp_rank == pp_size - 1 else model[0]
    if not _find_attr(chunk, "share_embeddings_and_output_weights"):
        return
    weight = _find_attr(chunk, "shared_embedding_or_output_weight")()
    dist.all_reduce(_grad_or_zeros(weight), group=embd_group)


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
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_tokens: Optional[torch.Tensor] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> None:
    """Finish this step's gradients for ``model`` (a list of model chunks, or one module) in place.

    ``num_tokens`` (a tensor holding this rank's token count, used with ``calculate_per_token_loss``) is summed over
    the data-parallel(+context-parallel) ranks of the last pipeline stage, shared with every stage, and every
    gradient is divided by it. ``pg_collection`` names the groups to use (tp, pp, embd, dp_cp); by default the
    ``parallel_state`` groups.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
    groups = _groups(pg_collection)
    _allreduce_tensor_parallel_partial_grads(chunks, groups.tp)
    _allreduce_word_embedding_grads(chunks, groups)
    if num_tokens is not None:
        if not isinstance(num_tokens, torch.Tensor):
            raise TypeError(
                f"finalize_model_grads: num_tokens must be a tensor (it is reduced across ranks), got "
                f"{type(num_tokens).__name__}; pass torch.tensor(count)"
            )
        _divide_by_num_tokens(chunks, num_tokens, groups)
