"""Cross entropy over vocab-parallel logits, on GPU without a softmax tensor (``--cross-entropy-loss-fusion``,
``--cross-entropy-fusion-impl native``).

Forward reduces each row of this rank's logit slice to three numbers (its maximum, the sum of exponentials below it,
and the target's logit where this rank owns the target); two all-reduces over the tensor-parallel group combine them
(the maximum, then both sums at once) and ``loss = log(sum exp) + max - target logit``. Backward recomputes
``softmax - one_hot(target)`` from the saved logits: no ``[tokens, vocab]`` tensor besides the logits. That is our
Triton kernel on CUDA (and the compiled CPU body with ``MEGATRON_LITE_COMPILE_FUSIONS=1``). Eagerly on CPU a second
exponential pass costs more than it saves, so the eager body keeps the softmax as the unfused loss does (same math).
"""

import torch
import torch.distributed as dist

from megatron.core.fusions.kernel_dispatch import compile_cpu_fusions, cpu_body, use_triton

_FUSION, _FLAG = "cross_entropy_loss_fusion", "no --cross-entropy-loss-fusion"


def cross_entropy_statistics(logits: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """``(row max, sum of exp(logit - row max), target logit or 0 where not owned)``, fp32, for 2-D ``logits``."""
    logits = logits.float()
    row_max = logits.max(dim=-1).values
    sum_exp = torch.exp(logits - row_max.unsqueeze(-1)).sum(dim=-1)
    local, owned = _local_target(target, vocab_start, logits.shape[-1])
    target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    return row_max, sum_exp, target_logit


def cross_entropy_backward(logits, target, row_max, sum_exp, grad_output, vocab_start: int) -> torch.Tensor:
    """``grad_output * (softmax(logits) - one_hot(target))`` from the globally reduced ``row_max`` and ``sum_exp``."""
    grad = torch.exp(logits.float() - row_max.unsqueeze(-1)).div_(sum_exp.unsqueeze(-1))
    local, owned = _local_target(target, vocab_start, logits.shape[-1])
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows, local] -= owned.to(grad.dtype)
    return grad.mul_(grad_output.unsqueeze(-1)).to(logits.dtype)


def _local_target(target: torch.Tensor, vocab_start: int, partition_vocab_size: int):
    local = target - vocab_start
    owned = (local >= 0) & (local < partition_vocab_size)
    return local.masked_fill(~owned, 0), owned


def _group_rank_size(tp_group) -> tuple[int, int]:
    if tp_group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, tp_group):
        rank, world_size = _group_rank_size(tp_group)
        logits = vocab_parallel_logits.reshape(-1, vocab_parallel_logits.shape[-1]).contiguous()
        target_1d = target.reshape(-1).contiguous()
        vocab_start = rank * logits.shape[-1]
        ctx.vocab_start, ctx.shape = vocab_start, vocab_parallel_logits.shape
        ctx.triton = use_triton(logits, _FUSION, _FLAG)
        if not ctx.triton and not compile_cpu_fusions():
            loss, softmax = _eager_forward(logits, target_1d, vocab_start, tp_group, world_size)
            ctx.save_for_backward(softmax, target_1d)
            return loss.view(target.shape)
        if ctx.triton:
            from megatron.core.fusions.kernels import cross_entropy as kernels

            row_max, sum_exp, target_logit = kernels.cross_entropy_statistics(logits, target_1d, vocab_start)
        else:
            row_max, sum_exp, target_logit = cpu_body(cross_entropy_statistics)(logits, target_1d, vocab_start)
        if world_size > 1:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            sums = torch.stack((sum_exp * torch.exp(row_max - global_max), target_logit))
            dist.all_reduce(sums, group=tp_group)
            row_max, (sum_exp, target_logit) = global_max, sums.unbind(0)
        ctx.save_for_backward(logits, target_1d, row_max, sum_exp)
        return (torch.log(sum_exp) + row_max - target_logit).view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.reshape(-1).float().contiguous()
        if len(ctx.saved_tensors) == 2:
            softmax, target_1d = ctx.saved_tensors
            grad = _softmax_backward(softmax, target_1d, grad_output, ctx.vocab_start)
        elif ctx.triton:
            from megatron.core.fusions.kernels import cross_entropy as kernels

            grad = kernels.cross_entropy_backward(*ctx.saved_tensors, grad_output, ctx.vocab_start)
        else:
            grad = cpu_body(cross_entropy_backward)(*ctx.saved_tensors, grad_output, ctx.vocab_start)
        return grad.view(ctx.shape), None, None


def _eager_forward(logits, target, vocab_start: int, tp_group, world_size: int):
    """``(loss, softmax)`` in the order that is fastest eagerly: the global maximum first, then one pass that
    exponentiates in place and keeps the softmax for backward (as the unfused cross entropy does)."""
    row_max = logits.float().max(dim=-1).values
    if world_size > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    softmax = (logits.float() - row_max.unsqueeze(-1)).exp_()
    local, owned = _local_target(target, vocab_start, logits.shape[-1])
    target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float().masked_fill(~owned, 0.0)
    sums = torch.stack((softmax.sum(dim=-1), target_logit))
    if world_size > 1:
        dist.all_reduce(sums, group=tp_group)
    sum_exp, target_logit = sums.unbind(0)
    loss = torch.log(sum_exp) + row_max - target_logit
    return loss, softmax.div_(sum_exp.unsqueeze(-1))


def _softmax_backward(softmax, target, grad_output, vocab_start: int) -> torch.Tensor:
    grad = softmax.clone()  # the saved softmax stays intact (backward may run again with retain_graph)
    local, owned = _local_target(target, vocab_start, softmax.shape[-1])
    grad[torch.arange(grad.shape[0], device=grad.device), local] -= owned.to(grad.dtype)
    return grad.mul_(grad_output.unsqueeze(-1))


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
    """Per-token cross entropy from this rank's ``[..., vocab / tp]`` logits and global ``target`` ids ``[...]``.

    ``tp_group`` is the group the vocabulary is split over (None: not split). Returns the fp32 loss shaped like
    ``target``. Label smoothing is not part of the fused loss (as in Megatron).
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group)
