"""Cross entropy over logits whose vocabulary dimension is split across the tensor-parallel group.

No rank ever holds the full ``[..., vocab]`` logits. Two collectives per call: an all-reduce (max) of the per-token
maximum, for a numerically stable softmax, then one all-reduce (sum) carrying three per-token sums at once: the
target's logit (only its owner contributes), the softmax denominator, and the sum of the logits (for label smoothing).
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import VocabUtility, group_rank, group_size, resolve_tp_group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group):
        world_size = group_size(group)
        partition_vocab_size = vocab_parallel_logits.size(-1)
        vocab_size = partition_vocab_size * world_size

        logits_max = vocab_parallel_logits.max(dim=-1).values
        if world_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = vocab_parallel_logits - logits_max.unsqueeze(-1)

        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, group_rank(group), world_size
        )
        not_here = (target < first) | (target >= last)
        local_target = (target - first).masked_fill(not_here, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_here, 0.0)

        sum_logits = shifted.sum(dim=-1) if label_smoothing > 0 else torch.zeros_like(target_logit)
        exp_logits = shifted.exp_()  # reuse the shifted buffer: it is not needed any more
        sums = torch.stack((target_logit, exp_logits.sum(dim=-1), sum_logits))
        if world_size > 1:
            dist.all_reduce(sums, group=group)
        target_logit, sum_exp_logits, sum_logits = sums.unbind(0)

        log_sum_exp = sum_exp_logits.log()
        loss = log_sum_exp - target_logit
        smoothing = 0.0
        if label_smoothing > 0:
            # Megatron's formula: spread label_smoothing over the K - 1 wrong classes, i.e.
            # loss = (1 - s) * nll - s * mean_k(log p_k) with s = label_smoothing * K / (K - 1).
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            mean_log_probs = sum_logits / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))
        ctx.smoothing = smoothing
        ctx.vocab_size = vocab_size
        ctx.save_for_backward(softmax, not_here, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, not_here, local_target = ctx.saved_tensors
        # d loss / d logit_k = p_k - (1 - s) * [k == target] - s / K, scaled by the incoming gradient.
        grad_input = softmax * grad_output.unsqueeze(-1)
        if ctx.smoothing > 0:
            grad_input.sub_((ctx.smoothing / ctx.vocab_size) * grad_output.unsqueeze(-1))
        target_term = ((1.0 - ctx.smoothing) * grad_output).masked_fill(not_here, 0.0)
        grad_input.scatter_add_(-1, local_target.unsqueeze(-1), -target_term.unsqueeze(-1).to(grad_input.dtype))
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """Per-token cross-entropy loss from vocab-sharded logits.

    Args:
        vocab_parallel_logits: ``[..., vocab / tp]`` (e.g. ``[s, b, v/tp]``), this rank's contiguous vocabulary slice.
        target: ``[...]`` global token ids (int64), the logits' shape without the last dimension.
        label_smoothing: in ``[0, 1)``; Megatron's definition (mass ``label_smoothing`` spread over the wrong
            classes), which equals ``torch.nn.functional.cross_entropy``'s with ``label_smoothing * K / (K - 1)``.
        tp_group: the group the vocabulary is split over (default: the tensor-parallel group).

    Returns:
        the loss, shaped like ``target``.
    """
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits shape without its vocabulary dimension "
            f"{tuple(vocab_parallel_logits.shape[:-1])} (logits are {tuple(vocab_parallel_logits.shape)})"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, resolve_tp_group(tp_group))
