"""Core attention against an explicit softmax reference: masks, GQA, bias, fp32 softmax; errors."""

import math

import torch

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import run_distributed

S, B, HEADS, D = 6, 2, 4, 8


def _config(**overrides):
    base = dict(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS, attention_dropout=0.0)
    return TransformerConfig(**{**base, **overrides})


def _reference(q, k, v, masked, bias=None):
    """softmax(q k^T / sqrt(d) + bias, masked -> -inf) v with [s, b, n, d] inputs, GQA by repeating k/v heads."""
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias.double()
    scores = scores.masked_fill(masked, float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v.double())
    return out.reshape(q.shape[0], q.shape[1], -1)


def _inputs(groups, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, HEADS, D, generator=g).to(dtype)
    k = torch.randn(S, B, groups, D, generator=g).to(dtype)
    v = torch.randn(S, B, groups, D, generator=g).to(dtype)
    return q, k, v


def _check_attention():
    parallel_state.initialize_model_parallel(1)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    padding = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    padding[1, ..., -2:] = True  # the second sequence has two padding positions
    documents = torch.ones(1, 1, S, S, dtype=torch.bool)  # block-diagonal: two documents of 3 tokens
    documents[..., :3, :3] = False
    documents[..., 3:, 3:] = False
    documents = documents | causal
    bias = torch.randn(1, HEADS, S, S, generator=torch.Generator().manual_seed(1))
    cases = [
        (4, AttnMaskType.causal, None, None, causal),
        (2, AttnMaskType.causal, None, None, causal),  # grouped-query attention
        (1, AttnMaskType.causal, None, None, causal),  # multi-query attention
        (4, AttnMaskType.padding, padding, None, padding),
        (4, AttnMaskType.causal, padding, None, padding | causal),
        (4, AttnMaskType.causal, documents, None, documents),
        (4, AttnMaskType.no_mask, None, None, torch.zeros(S, S, dtype=torch.bool)),
        (4, AttnMaskType.causal, None, bias, causal),
    ]
    errors = []
    for groups, mask_type, mask, attention_bias, masked in cases:
        attention = DotProductAttention(_config(num_query_groups=groups), 1, mask_type, "self")
        q, k, v = _inputs(groups)
        out = attention(q, k, v, mask, attention_bias=attention_bias)
        expected = _reference(q, k, v, masked, attention_bias)
        errors.append(((out.double() - expected).abs().max() / expected.abs().max()).item())

    # bf16 inputs: the softmax runs in fp32 and the output comes back in bf16
    attention = DotProductAttention(_config(), 1, AttnMaskType.causal, "self")
    q, k, v = _inputs(HEADS, torch.bfloat16)
    out = attention(q, k, v, None)
    bf16_error = ((out.double() - _reference(q, k, v, causal)).abs().max()).item()
    return errors, out.dtype, bf16_error


def test_attention_matches_explicit_softmax():
    errors, dtype, bf16_error = run_distributed(1, _check_attention)[0]
    assert max(errors) < 1e-6, errors
    assert dtype == torch.bfloat16
    assert bf16_error < 2e-2


def _with_context_parallelism():
    # A config asking for CP=2 while the process groups were initialised without CP.
    config = _config()
    config.context_parallel_size = 2
    return config


def _errors():
    parallel_state.initialize_model_parallel(1)
    messages = []
    attention = DotProductAttention(_config(), 1, AttnMaskType.causal, "self")
    q, k, v = _inputs(HEADS)
    for call in (
        lambda: attention(q, k, v, torch.zeros(1, 1, S, S)),
        lambda: attention(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd")),
        lambda: DotProductAttention(_with_context_parallelism(), 1, AttnMaskType.causal, "self"),
    ):
        try:
            call()
            messages.append(None)
        except (TypeError, ValueError) as error:
            messages.append(str(error))
    return messages


def test_attention_errors():
    bad_mask, packed, cp = run_distributed(1, _errors)[0]
    assert bad_mask == "attention_mask must be a bool tensor (True = masked), got torch.float32"
    assert packed == "packed_seq_params needs qkv_format='thd' and [t, heads, d] query/key/value"
    assert cp.startswith("context_parallel_size=2 but the context-parallel group has 1 ranks")
