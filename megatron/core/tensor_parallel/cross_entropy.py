"""Cross entropy over logits whose vocabulary dimension is split across the tensor-parallel group.

No rank ever holds the full ``[..., vocab]`` logits. Two collectives per call: an all-reduce (max) of the per-token
maximum, for a numerically stable softmax, then one all-reduce (sum) carrying three per-token sums at once: the
target's logit (only its owner contributes), the softmax denominator, and the sum of the logits (for label smoothing).
"""

from typing import Tuple

import torch
import torch.distributed as dist

from megatron.core.parallel_state import get_tensor_model_parallel_group
from megatron.core.tensor_parallel.utils import VocabUtility, group_rank, group_size


class VocabParallelCrossEntropy:
    """The steps of the vocab-parallel cross entropy as separate functions (Megatron's building blocks, reused by
    fused implementations). Each works on this rank's ``[..., vocab / tp]`` slice; the collectives between the steps
    are the caller's."""

    @staticmethod
    def calculate_logits_max(vocab_parallel_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The logits in fp32 and their local maximum over the vocabulary slice (to be all-reduced with MAX)."""
        vocab_parallel_logits = vocab_parallel_logits.float()
        return vocab_parallel_logits, vocab_parallel_logits.max(dim=-1).values

    @staticmethod
    def calculate_predicted_logits(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        logits_max: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shift by the global maximum and pick out the target's logit where this rank owns the target.

        Returns ``(target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits)``: ``target_mask`` is
        True where the target lies outside ``[vocab_start_index, vocab_end_index)``; ``masked_target_1d`` the local
        target index (0 where not owned), flattened; ``predicted_logits`` the shifted target logit (0 where not
        owned) and ``sum_exp_logits`` the local softmax denominator, both to be all-reduced (sum). The input logits
        are left unchanged.
        """
        shifted = vocab_parallel_logits - logits_max.unsqueeze(-1)
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = (target - vocab_start_index).masked_fill(target_mask, 0)
        predicted_logits = shifted.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1).masked_fill(target_mask, 0.0)
        exp_logits = shifted.exp_()  # the shifted copy is not needed any more
        sum_exp_logits = exp_logits.sum(dim=-1)
        return target_mask, masked_target.reshape(-1), predicted_logits, sum_exp_logits, exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(
        exp_logits: torch.Tensor, predicted_logits: torch.Tensor, sum_exp_logits: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """From the globally reduced sums: ``(softmax, loss)`` with ``loss = log(sum exp) - target logit``; the
        softmax is computed in ``exp_logits``' memory."""
        loss = torch.log(sum_exp_logits) - predicted_logits
        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))
        return softmax, loss

    @staticmethod
    def prepare_gradient_calculation_operands(
        softmax: torch.Tensor, target_mask: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(grad_2d, arange_1d, softmax_update, grad_input)``: the gradient starts as the softmax (``grad_input``,
        with ``grad_2d`` its ``[tokens, vocab / tp]`` view); ``softmax_update`` is 1 where this rank owns the target
        (to be subtracted at the target index) and 0 elsewhere."""
        grad_input = softmax
        grad_2d = grad_input.view(-1, softmax.size(-1))
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        softmax_update = 1.0 - target_mask.reshape(-1).to(softmax.dtype)
        return grad_2d, arange_1d, softmax_update, grad_input

    @staticmethod
    def calculate_gradients(
        grad_2d: torch.Tensor,
        arange_1d: torch.Tensor,
        masked_target_1d: torch.Tensor,
        softmax_update: torch.Tensor,
        grad_input: torch.Tensor,
        grad_output: torch.Tensor,
    ) -> torch.Tensor:
        """``d loss / d logits = (softmax - one_hot(target)) * grad_output``, in ``grad_input``'s memory."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        # None: the tensor-parallel group, or a one-rank group when no model-parallel groups exist.
        group = tp_group if tp_group is not None else get_tensor_model_parallel_group(check_initialized=False)
        world_size = group_size(group)
        partition_vocab_size = vocab_parallel_logits.size(-1)
        vocab_size = partition_vocab_size * world_size

        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(vocab_parallel_logits)
        if world_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, group_rank(group), world_size
        )
        sum_logits = (logits - logits_max.unsqueeze(-1)).sum(dim=-1) if label_smoothing > 0 else None
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, first, last)
        )
        if sum_logits is None:
            sum_logits = torch.zeros_like(predicted_logits)
        # One all-reduce carries the three per-token sums.
        sums = torch.stack((predicted_logits, sum_exp_logits, sum_logits))
        if world_size > 1:
            dist.all_reduce(sums, group=group)
        predicted_logits, sum_exp_logits, sum_logits = sums.unbind(0)

        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted_logits, sum_exp_logits
        )
        smoothing = 0.0
        if label_smoothing > 0:
            # Megatron's formula: spread label_smoothing over the K - 1 wrong classes, i.e.
            # loss = (1 - s) * nll - s * mean_k(log p_k) with s = label_smoothing * K / (K - 1).
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            mean_log_probs = sum_logits / vocab_size - torch.log(sum_exp_logits)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        ctx.smoothing = smoothing
        ctx.vocab_size = vocab_size
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax.clone(), target_mask)
        )
        if ctx.smoothing > 0:
            # d loss / d logit_k = p_k - (1 - s) * [k == target] - s / K.
            softmax_update = softmax_update * (1.0 - ctx.smoothing)
            grad_2d.sub_(ctx.smoothing / ctx.vocab_size)
        grad_input = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output.to(grad_input.dtype)
        )
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: torch.distributed.ProcessGroup | None = None,
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
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group)
