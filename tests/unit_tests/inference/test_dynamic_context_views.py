"""The dynamic context's attention reads keys/values in place (a strided view of the block pool) when the requests'
blocks are consecutive and evenly spaced, and gathers them otherwise; both give exactly the attention of each
request over its own cached tokens."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megatron.core.inference.contexts import DynamicInferenceContext

HEADS, D, BLOCK = 2, 8, 4


def _core_attention(query, key, value, mask, **_):
    """[max_q, r, heads, d] queries over [L, r, heads, d] keys; mask True = hidden (the contexts' convention)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else ~mask)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


ATTENTION = SimpleNamespace(layer_number=1, core_attention=_core_attention)


def _step(context, history, chunks, generator):
    """Run one step of ``chunks`` ({request: number of new tokens}) through cached_attention; compare each token's
    output with attention over that request's keys/values so far, kept here in ``history``."""
    context.prepare_step([(rid, [0] * n) for rid, n in chunks.items()])
    t = sum(chunks.values())
    query, key, value = (torch.randn(t, 1, HEADS, D, generator=generator) for _ in range(3))
    out = context.cached_attention(ATTENTION, query, key, value, None)
    used_view = "view" in context._step
    row = 0
    for rid, n in chunks.items():
        keys, values = history.setdefault(rid, ([], []))
        for j in range(n):
            keys.append(key[row + j, 0])
            values.append(value[row + j, 0])
            k, v = torch.stack(keys).transpose(0, 1), torch.stack(values).transpose(0, 1)  # [heads, len, d]
            expected = F.scaled_dot_product_attention(query[row + j, 0][:, None], k, v)[:, 0].reshape(-1)
            torch.testing.assert_close(out[row + j, 0], expected, rtol=1e-5, atol=1e-6)
        row += n
    context.commit_step()
    return used_view


def test_strided_view_and_gather_both_attend_over_each_requests_own_tokens():
    generator = torch.Generator().manual_seed(0)
    context = DynamicInferenceContext(
        torch.float32,
        1,
        D,
        HEADS,
        24,
        block_size_tokens=BLOCK,
        num_blocks=16,
        max_requests=4,
        max_tokens=64,
        device=torch.device("cpu"),
    )
    history = {}
    for rid in "abc":  # admitted together into a fresh pool: blocks 0-2, 3-5, 6-8
        context.add_request(rid, 12)
    # Prompts of different lengths (masked), then decodes at different lengths, all over a strided view.
    assert _step(context, history, {"a": 5, "b": 3, "c": 7}, generator)
    assert _step(context, history, {"a": 1, "b": 1, "c": 1}, generator)
    assert _step(context, history, {"b": 1, "c": 1}, generator)  # a stride of 3 blocks still
    # A lone request whose blocks are consecutive: a view of exactly its tokens.
    assert _step(context, history, {"a": 1}, generator)
    # Uneven spacing: "b" leaves, "d" takes its blocks and two more elsewhere; a and d are not evenly spaced from c.
    context.release_request("b")
    context.add_request("d", 20)  # 5 blocks: 3, 4, 5, 9, 10 (not consecutive)
    assert not _step(context, history, {"d": 13}, generator)  # reads blocks 3, 4, 5, 9
    assert not _step(context, history, {"a": 1, "c": 1, "d": 1}, generator)
    # Later requests sitting earlier in the pool cannot be a view (its strides would be negative): gathered.
    assert not _step(context, history, {"c": 1, "a": 1}, generator)
    assert context.request_length("a") == 9


def test_a_batch_admitted_after_others_finished_in_any_order_still_gets_a_view():
    generator = torch.Generator().manual_seed(1)
    context = DynamicInferenceContext(
        torch.float32,
        1,
        D,
        HEADS,
        16,
        block_size_tokens=BLOCK,
        num_blocks=8,
        max_requests=4,
        max_tokens=64,
        device=torch.device("cpu"),
    )
    for rid in "abcd":
        context.add_request(rid, 8)
    for rid in "cadb":  # the free list is kept sorted whatever the order requests finish in
        context.release_request(rid)
    history = {}
    for rid in "efg":
        context.add_request(rid, 8)
    assert _step(context, history, {"e": 3, "f": 4, "g": 2}, generator)
    assert _step(context, history, {"e": 1, "f": 1, "g": 1}, generator)
