"""Run by test_flash_attention_triton.py in a subprocess with TRITON_INTERPRET=1 (set before triton is imported, so
no other test sees the interpreter): the Triton flash kernel and the ``flash`` attention backend against the
explicit reference on CPU. Prints one JSON object of maximum errors."""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from megatron.core.fusions.fused_flash_attention import attention_reference, flash_attention, sliding_window_mask

# name: (batch, heads, groups, sq, sk, head_dim, causal, window_size, softcap, q_offset)
KERNEL_CASES = {
    "causal-gqa": (1, 4, 2, 20, 20, 8, True, None, 0.0, 0),
    "window-softcap-offset": (1, 4, 2, 17, 33, 16, True, (4, 0), 3.0, 16),
    "two-sided-window-mqa": (2, 2, 1, 20, 20, 16, False, (3, 2), 2.0, 0),
}

BF16_CASES = ("causal-gqa", "window-softcap-offset")


def _inputs(case, dtype, seed=0):
    b, h, g, sq, sk, d = case[:6]
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, h, sq, d), (b, g, sk, d), (b, g, sk, d), (b, h, sq, d))
    return [torch.randn(*shape, generator=gen).to(dtype) for shape in shapes]


def _max_errors(results, references):
    return [(a.double() - r.double()).abs().max().item() for a, r in zip(results, references)]


def _run(q, k, v, dout, case, scale, impl):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = impl(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def kernel_errors(case, dtype):
    """Errors of the kernel and of the eager reference at ``dtype`` against the fp64 reference (out, dq, dk, dv),
    and the kernel's log-sum-exp error."""
    _, _, _, sq, sk, d, causal, window, softcap, q_offset = case
    q, k, v, dout = _inputs(case, dtype)
    scale = d**-0.5
    masked = sliding_window_mask(sq, sk, q_offset, causal, window, q.device)
    exact = _run(*(t.double() for t in (q, k, v, dout)), case, scale,
                 lambda a, b, c: attention_reference(a, b, c, scale, masked, softcap=softcap))  # fmt: skip
    eager = _run(
        q, k, v, dout, case, scale, lambda a, b, c: attention_reference(a, b, c, scale, masked, softcap=softcap)
    )
    kernel = _run(q, k, v, dout, case, scale,
                  lambda a, b, c: flash_attention(a, b, c, scale, causal, window, softcap, q_offset)[0])  # fmt: skip
    scores = torch.matmul(q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2))
    scores = scores * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    lse = flash_attention(q, k, v, scale, causal, window, softcap, q_offset)[1]
    return {
        "kernel": _max_errors(kernel, exact),
        "eager": _max_errors(eager, exact),
        "lse": (lse.double() - torch.logsumexp(scores, -1)).abs().max().item(),
    }


def backend_errors():
    """DotProductAttention with attention_backend=flash and a window (the Triton path) against unfused: training
    forward and backward, and an inference-shaped call (3 new queries over 12 cached keys)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    calls = []
    kernel = dpa.flash_attention
    dpa.flash_attention = lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0)

    def module(backend):
        config = TransformerConfig(**base, window_size=(4, 0), attention_backend=backend)
        attention = dpa.DotProductAttention(config, 1, AttnMaskType.causal, "self")
        return lambda query, key, value, **kwargs: attention(query, key, value, None, **kwargs)

    gen = torch.Generator().manual_seed(1)
    q, dout = torch.randn(12, 2, 4, 8, generator=gen), torch.randn(12, 2, 32, generator=gen)
    k, v = torch.randn(12, 2, 2, 8, generator=gen), torch.randn(12, 2, 2, 8, generator=gen)
    flash = _run(q, k, v, dout, None, None, module(AttnBackend.flash))
    unfused = _run(q, k, v, dout, None, None, module(AttnBackend.unfused))
    decode = [
        m(q[-3:], k, v, attn_mask_type=AttnMaskType.causal_bottom_right)
        for m in (module(AttnBackend.flash), module(AttnBackend.unfused))
    ]
    dist.destroy_process_group()
    os.unlink(store.name)
    return {
        "training": _max_errors(flash, unfused),
        "inference": _max_errors(decode[:1], decode[1:]),
        "kernel_calls": len(calls),
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    report = {f"{name}/float32": kernel_errors(case, torch.float32) for name, case in KERNEL_CASES.items()}
    report.update({f"{name}/bfloat16": kernel_errors(KERNEL_CASES[name], torch.bfloat16) for name in BF16_CASES})
    report["backend"] = backend_errors()
    json.dump(report, sys.stdout)
