"""vocab_parallel_cross_entropy against torch.nn.functional.cross_entropy at TP=1, 2 and 4: loss and gradient."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.unit_tests.tensor_parallel.common import assert_rel_close, gather, local_slice
from tests.unit_tests.test_utilities import Utils, run_distributed

S, B, VOCAB = 4, 3, 16
LABEL_SMOOTHINGS = (0.0, 0.1)


def _batch():
    g = torch.Generator().manual_seed(3)
    logits = 3.0 * torch.randn(S, B, VOCAB, generator=g)
    logits[0, 0] += 1e4  # far outside exp()'s range: only a max-shifted softmax survives this
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    target[0, 0] = VOCAB - 1  # owned by the last rank
    upstream = torch.rand(S, B, generator=g)
    return logits, target, upstream


def _vocab_parallel_results():
    """Loss and gathered logits gradient for each label smoothing, on this rank's vocabulary slice."""
    logits, target, upstream = _batch()
    results = {}
    for label_smoothing in LABEL_SMOOTHINGS:
        shard = local_slice(logits, -1).requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, target, label_smoothing=label_smoothing)
        (loss * upstream).sum().backward()
        results[label_smoothing] = (loss.detach(), gather(shard.grad, -1))
    return results


def _run_on_ranks(tp):
    Utils.initialize_model_parallel(tp)
    results = _vocab_parallel_results()
    return results if dist.get_rank() == 0 else None


def _torch_reference(label_smoothing):
    logits, target, upstream = _batch()
    logits.requires_grad_()
    # Megatron spreads label_smoothing over the K - 1 wrong classes; torch spreads it over all K classes.
    torch_smoothing = label_smoothing * VOCAB / (VOCAB - 1)
    loss = F.cross_entropy(
        logits.view(-1, VOCAB), target.view(-1), reduction="none", label_smoothing=torch_smoothing
    ).view(S, B)
    (loss * upstream).sum().backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_torch_cross_entropy(tp):
    results = _vocab_parallel_results() if tp == 1 else run_distributed(tp, _run_on_ranks, tp)[0]
    for label_smoothing, (loss, grad) in results.items():
        expected_loss, expected_grad = _torch_reference(label_smoothing)
        assert torch.isfinite(loss).all()
        assert_rel_close(loss, expected_loss, what=f"tp={tp} label_smoothing={label_smoothing} loss")
        assert_rel_close(grad, expected_grad, what=f"tp={tp} label_smoothing={label_smoothing} grad")


def test_any_leading_shape_and_the_callers_logits_are_left_alone():
    logits = torch.randn(5, VOCAB)
    before = logits.clone()
    loss = vocab_parallel_cross_entropy(logits, torch.arange(5))
    assert torch.equal(logits, before)
    assert_rel_close(loss, F.cross_entropy(before, torch.arange(5), reduction="none"))


def test_target_shape_must_match_the_logits():
    with pytest.raises(
        ValueError,
        match=r"target shape \(4, 2\) must equal the logits shape without its vocabulary "
        r"dimension \(4, 3\) \(logits are \(4, 3, 16\)\)",
    ):
        vocab_parallel_cross_entropy(torch.zeros(4, 3, 16), torch.zeros(4, 2, dtype=torch.long))


@pytest.mark.parametrize("label_smoothing", [-0.1, 1.0])
def test_label_smoothing_must_be_in_range(label_smoothing):
    with pytest.raises(ValueError, match=rf"label_smoothing must be in \[0, 1\), got {label_smoothing}"):
        vocab_parallel_cross_entropy(torch.zeros(2, 16), torch.zeros(2, dtype=torch.long), label_smoothing)
