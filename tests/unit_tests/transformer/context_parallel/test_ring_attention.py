"""Context-parallel core attention alone equals full attention: every cp_comm_type, causal or not, GQA, masks.

Each rank builds the same full-sequence q/k/v, keeps its load-balanced chunks, runs the CP attention and checks its
output and its q/k/v gradients against the matching rows of single-process attention.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.context_parallel import ContextParallelAttention, RingLayout, ring_attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import chunks_of_cp_rank
from tests.unit_tests.test_utilities import run_distributed

B, HEADS, GROUPS, D = 2, 8, 4, 8


def _reference(q, k, v, mask, causal, scale):
    """Single-process attention on [s, b, n, d] tensors; mask [b, 1, s, s] True = masked."""
    qq, kk, vv = (
        t.permute(1, 2, 0, 3)
        for t in (q, k.repeat_interleave(HEADS // GROUPS, 2), v.repeat_interleave(HEADS // GROUPS, 2))
    )
    s = q.shape[0]
    masked = torch.zeros(1, 1, s, s, dtype=torch.bool)
    if causal:
        masked = masked | torch.ones(s, s, dtype=torch.bool).triu(1)
    if mask is not None:
        masked = masked | mask
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=~masked, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(s, q.shape[1], -1)


def _check_against_full(cases, seq):
    cp = dist.get_world_size()
    parallel_state.initialize_model_parallel(
        context_parallel_size=cp, hierarchical_context_parallel_sizes=[2, cp // 2] if cp == 4 else None
    )
    group = parallel_state.get_context_parallel_group()
    rank = dist.get_rank(group)
    scale = 1.0 / math.sqrt(D)
    errors = {}
    for comm_type, causal, with_mask in cases:
        generator = torch.Generator().manual_seed(11)
        q = torch.randn(seq, B, HEADS, D, generator=generator)
        k = torch.randn(seq, B, GROUPS, D, generator=generator)
        v = torch.randn(seq, B, GROUPS, D, generator=generator)
        dout = torch.randn(seq, B, HEADS * D, generator=generator)
        mask = None
        if with_mask:  # random padding-style mask over keys and some arbitrary holes; every row keeps its diagonal
            mask = torch.rand(B, 1, seq, seq, generator=generator) < 0.3
            mask = mask & ~torch.eye(seq, dtype=torch.bool)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = _reference(*full, mask, causal, scale)
        expected.backward(dout)
        local = [chunks_of_cp_rank(t, 0, cp, rank).detach().requires_grad_() for t in (q, k, v)]
        local_mask = None if mask is None else chunks_of_cp_rank(mask, 2, cp, rank)
        mask_type = AttnMaskType.causal if causal else AttnMaskType.no_mask
        attention = ContextParallelAttention(
            comm_type,
            group,
            mask_type,
            scale,
            HEADS,
            GROUPS,
            parallel_state.get_hierarchical_context_parallel_groups(False),
        )
        out = attention(*local, local_mask, None, 0.0, False)
        out.backward(chunks_of_cp_rank(dout, 0, cp, rank))
        key = f"{comm_type} causal={causal} mask={with_mask}"
        pairs = [(out, expected)] + [(t.grad, f.grad) for t, f in zip(local, full)]
        errors[key] = max(
            ((a - chunks_of_cp_rank(e.detach(), 0, cp, rank)).abs().max() / e.abs().max()).item() for a, e in pairs
        )
    return errors


def _assert_small(results, tolerance=1e-5):
    for errors in results:
        for key, error in errors.items():
            assert error < tolerance, f"{key}: relative error {error:.2e}"


def test_every_comm_type_equals_full_attention_on_four_ranks():
    cases = [
        (c, causal, m)
        for c in ("p2p", "all_gather", "a2a", "a2a+p2p")
        for causal in (True, False)
        for m in (False, True)
    ]
    _assert_small(run_distributed(4, _check_against_full, cases, 32))


def test_ring_with_an_odd_number_of_ranks_and_a_long_mask():
    # Three ranks: six chunks, an odd number of ring steps; 96 tokens with a random mask over all of them.
    cases = [("p2p", True, True), ("p2p", False, True), ("all_gather", True, True)]
    _assert_small(run_distributed(3, _check_against_full, cases, 96))


def _bf16_against_fp32():
    """bf16 inputs run the blocks in fp32 and return bf16: within bf16 rounding of the fp32 result."""
    cp = dist.get_world_size()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    group = parallel_state.get_context_parallel_group()
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(16, B, n, D, generator=generator) for n in (HEADS, GROUPS, GROUPS))
    errors = {}
    for comm_type in ("p2p", "all_gather", "a2a"):
        attention = ContextParallelAttention(comm_type, group, AttnMaskType.causal, 1 / math.sqrt(D), HEADS, GROUPS)
        local = [chunks_of_cp_rank(t, 0, cp, dist.get_rank(group)) for t in (q, k, v)]
        exact = attention(*local, None, None, 0.0, False)
        low = [t.bfloat16().requires_grad_() for t in local]
        out = attention(*low, None, None, 0.0, False)
        out.float().sum().backward()
        assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)
        errors[comm_type] = ((out.float() - exact).abs().max() / exact.abs().max()).item()
    return errors


def test_bf16_inputs():
    _assert_small(run_distributed(2, _bf16_against_fp32), tolerance=2e-2)


def _ring_dropout_directional_derivative():
    """With dropout the ring backward must be the derivative of the ring forward under the same masks: compare
    <grad, u> with a central difference in float64 (the generator is reset before every call)."""
    cp = dist.get_world_size()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    group = parallel_state.get_context_parallel_group()
    rank = dist.get_rank(group)
    layout = RingLayout(group, (rank, 2 * cp - 1 - rank), tuple((r, 2 * cp - 1 - r) for r in range(cp)), 3, True)
    generator = torch.Generator().manual_seed(5 + rank)
    q = torch.randn(1, GROUPS, 2, 6, D, dtype=torch.float64, generator=generator)
    k = torch.randn(1, GROUPS, 1, 6, D, dtype=torch.float64, generator=generator)
    v = torch.randn(1, GROUPS, 1, 6, D, dtype=torch.float64, generator=generator)
    weights = torch.randn(1, GROUPS, 2, 6, D, dtype=torch.float64, generator=generator)
    directions = [torch.randn(t.shape, dtype=torch.float64, generator=generator) for t in (q, k, v)]

    def objective(tensors):
        torch.manual_seed(99)
        out = ring_attention(*tensors, None, layout, 0.3, 0.25)
        total = (out * weights).sum()
        dist.all_reduce(total, group=group)  # the loss over the whole sequence
        return total, out

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    total, out = objective(inputs)
    (out * weights).sum().backward()
    analytic = sum((t.grad * u).sum() for t, u in zip(inputs, directions))
    dist.all_reduce(analytic, group=group)
    eps = 1e-6
    plus, _ = objective([t + eps * u for t, u in zip((q, k, v), directions)])
    minus, _ = objective([t - eps * u for t, u in zip((q, k, v), directions)])
    numeric = (plus - minus) / (2 * eps)
    torch.manual_seed(99)
    no_dropout = ring_attention(q, k, v, None, layout, 0.3, 0.0)
    return analytic.item(), numeric.item(), (out.detach() - no_dropout).abs().max().item()


def test_ring_backward_with_dropout_is_the_derivative_of_its_forward():
    for analytic, numeric, dropout_effect in run_distributed(2, _ring_dropout_directional_derivative):
        assert abs(analytic - numeric) <= 1e-6 * max(1.0, abs(numeric)), (analytic, numeric)
        assert dropout_effect > 1e-3  # dropout really dropped something


def _seed_dropout_runs_forked():
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    model_parallel_cuda_manual_seed(7)
    group = parallel_state.get_context_parallel_group()
    attention = ContextParallelAttention("p2p", group, AttnMaskType.causal, 0.5, HEADS, GROUPS)
    q = torch.randn(8, 1, HEADS, D)
    k = torch.randn(8, 1, GROUPS, D)
    before = torch.get_rng_state()
    first = attention(q, k, k, None, None, 0.5, False)
    # Dropout drew from the tensor-parallel stream, not the default generator, and the stream advanced.
    assert torch.equal(before, torch.get_rng_state())
    second = attention(q, k, k, None, None, 0.5, False)
    return (first - second).abs().max().item()


def test_dropout_draws_from_the_tensor_parallel_stream():
    for difference in run_distributed(2, _seed_dropout_runs_forked):
        assert difference > 0.0


@pytest.mark.parametrize(
    "args, message",
    [
        (("ring", None, AttnMaskType.causal, 1.0, 4, 2), r"cp_comm_type='ring' is not one of p2p, all_gather, a2a"),
        (("a2a+p2p", None, AttnMaskType.causal, 1.0, 4, 2), r"cp_comm_type='a2a\+p2p' needs hierarchical_context"),
    ],
)
def test_constructor_errors(args, message, monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match=message):
        ContextParallelAttention(*args)


def test_a2a_head_count_error(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match=r"cp_comm_type='a2a' splits heads over 4 .* has 2 num_query_groups"):
        ContextParallelAttention("a2a", None, AttnMaskType.causal, 1.0, 4, 2)
