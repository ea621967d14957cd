"""vocab_parallel_cross_entropy against torch.nn.functional.cross_entropy at TP=1, 2 and 4: loss and gradient."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.models.common.language_module import language_module as language_module_module
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel import cross_entropy as cross_entropy_module
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


def _explicit_group_loss():
    """Two ranks whose parallel_state TP group has one rank; the vocabulary is split over an explicit 2-rank group."""
    Utils.initialize_model_parallel(1)
    vocab_group = dist.new_group([0, 1])
    logits, target, _ = _batch()
    shard = logits.chunk(2, dim=-1)[dist.get_rank()]
    return vocab_parallel_cross_entropy(shard, target, tp_group=vocab_group)


def test_explicit_tp_group_is_the_one_the_vocabulary_is_reduced_over():
    logits, target, _ = _batch()
    expected = F.cross_entropy(logits.view(-1, VOCAB), target.view(-1), reduction="none").view(S, B)
    for loss in run_distributed(2, _explicit_group_loss):
        assert_rel_close(loss, expected, what="loss over the explicit group")


def test_explicit_tp_group_does_not_consult_parallel_state(monkeypatch):
    def no_default_group(*args, **kwargs):
        raise AssertionError("an explicit tp_group must not read parallel_state")

    monkeypatch.setattr(cross_entropy_module, "get_tensor_model_parallel_group", no_default_group)
    logits, target = torch.randn(3, VOCAB), torch.tensor([0, 5, VOCAB - 1])
    loss = vocab_parallel_cross_entropy(logits, target, tp_group=_OneRankGroup())
    assert_rel_close(loss, F.cross_entropy(logits, target, reduction="none"))
    # Megatron's autograd function takes the same optional arguments.
    loss = cross_entropy_module._VocabParallelCrossEntropy.apply(logits, target, 0.0, _OneRankGroup())
    assert_rel_close(loss, F.cross_entropy(logits, target, reduction="none"))


class _OneRankGroup:
    def rank(self):
        return 0

    def size(self):
        return 1


def test_language_model_loss_uses_the_models_tp_group(monkeypatch):
    seen = {}

    def recording_cross_entropy(logits, labels, label_smoothing=0.0, tp_group=None):
        seen["tp_group"] = tp_group
        return torch.zeros_like(labels, dtype=logits.dtype)

    monkeypatch.setattr(language_module_module.tensor_parallel, "vocab_parallel_cross_entropy", recording_cross_entropy)
    group = _OneRankGroup()
    # Megatron's test passes only these attributes (the config only says whether the loss is fused).
    model = SimpleNamespace(tp_group=group, config=SimpleNamespace(cross_entropy_loss_fusion=False))
    loss = LanguageModule.compute_language_model_loss(model, torch.zeros(2, 3, dtype=torch.long), torch.randn(3, 2, 8))
    assert seen["tp_group"] is group and loss.shape == (2, 3)
