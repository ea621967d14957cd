"""Every refusal of the context-parallel attention path, with its message (raised before any collective)."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import run_distributed


def _config(**overrides):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, context_parallel_size=2)
    base.update(overrides)
    return TransformerConfig(**base)


def _refusals():
    messages = {}

    def record(name, function):
        try:
            function()
        except ValueError as error:
            messages[name] = str(error)

    parallel_state.initialize_model_parallel(context_parallel_size=2)
    config = _config()
    record("cross", lambda: DotProductAttention(config, 1, AttnMaskType.padding, "cross"))
    record("size", lambda: DotProductAttention(_config(context_parallel_size=4), 1, AttnMaskType.causal, "self"))
    attention = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    q = torch.zeros(4, 1, 4, 8)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_kv=torch.tensor([0, 4]))
    record("thd", lambda: attention(q, q, q, None, packed_seq_params=packed))
    record("bias", lambda: attention(q, q, q, None, attention_bias=torch.zeros(1, 4, 4, 8)))
    record("odd", lambda: attention(torch.zeros(3, 1, 4, 8), torch.zeros(3, 1, 4, 8), torch.zeros(3, 1, 4, 8), None))
    record("mask", lambda: attention(q, q, q, torch.zeros(1, 1, 4, 4, dtype=torch.bool)))
    parallel_state.destroy_model_parallel()
    record(
        "hierarchy",
        lambda: parallel_state.initialize_model_parallel(
            context_parallel_size=2, hierarchical_context_parallel_sizes=[2, 2]
        ),
    )
    return messages


EXPECTED = {
    "cross": r"context parallelism supports self-attention only, not 'cross' attention; use context_parallel_size=1",
    "size": r"context_parallel_size=4 but the context-parallel group has 2 ranks",
    "thd": r"not supported yet: packed sequences \(THD\) with context parallelism",
    "bias": r"not supported yet: attention_bias with context parallelism",
    "odd": r"context parallelism needs an even number of tokens per CP rank \(got 3\); use a sequence length "
    r"divisible by 2 x context_parallel_size = 4",
    "mask": r"attention_mask must be this rank's query rows over all keys, \[b or 1, 1, 4, 8\] .*got \(1, 1, 4, 4\)",
    "hierarchy": r"hierarchical_context_parallel_sizes=\[2, 2\] multiply to 4, not context_parallel_size=2",
}


def test_every_refusal_names_the_problem_and_the_fix():
    import re

    for messages in run_distributed(2, _refusals):
        assert messages.keys() == EXPECTED.keys(), sorted(messages)
        for name, pattern in EXPECTED.items():
            assert re.search(pattern, messages[name]), f"{name}: {messages[name]}"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(cp_comm_type=["p2p", "nope"]), r"cp_comm_type='nope' is not one of"),
        (
            dict(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[4]),
            r"needs hierarchical_context_parallel_sizes=\[a2a size, p2p size\] "
            r"with product context_parallel_size=4, got \[4\]",
        ),
        (dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 0]), r"must be positive integers"),
        (
            dict(
                context_parallel_size=4,
                cp_comm_type="a2a+p2p",
                hierarchical_context_parallel_sizes=[4, 1],
                num_query_groups=2,
            ),
            r"cp_comm_type='a2a\+p2p' scatters heads over 4 .* num_query_groups=2",
        ),
    ],
)
def test_config_refusals(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def _hierarchical_group_ranks():
    import torch.distributed as dist

    parallel_state.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    return [
        sorted(dist.get_process_group_ranks(group))
        for group in parallel_state.get_hierarchical_context_parallel_groups()
    ]


def test_hierarchical_groups_are_consecutive_then_strided():
    # Level 0 (a2a) groups consecutive CP ranks, level 1 (p2p) ranks a2a-size apart, as Megatron builds them.
    results = run_distributed(4, _hierarchical_group_ranks)
    assert results == [[[0, 1], [0, 2]], [[0, 1], [1, 3]], [[2, 3], [0, 2]], [[2, 3], [1, 3]]]
