"""Per-fusion speed on CPU: forward + backward of each fused op against the unfused PyTorch ops the model runs with
the fusion off, on the reference model's shapes (1,024 tokens: seq 256 x micro-batch 4; hidden 256, FFN 1024,
vocab 8192; fp32).

For each fusion three bodies are timed, interleaved round by round so that load on the machine hits them alike:

- ``unfused``: the model's code with the flag off (autograd over the separate ops);
- ``fused eager``: our autograd function with its PyTorch body (what runs on CPU with the flag on);
- ``compiled``: the same math through ``torch.compile`` (inductor), with its one-off compile time measured too.

Gradient-accumulation fusion (``wgrad accum`` rows) is a linear layer's forward + backward with DDP's hook moving
``weight.grad`` into an fp32 ``main_grad``: unfused (weight gradient into a temporary, then added) against fused (the
GEMM accumulates into ``main_grad``); there is nothing to compile.

    python benchmarks/bench_fusions.py [--threads 2 --rounds 15]

Prints a table (median ms per forward + backward) and writes benchmarks/results/fusions.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu, fused_cross_entropy  # noqa: E402
from megatron.core.fusions import fused_bias_dropout, fused_softmax  # noqa: E402
from megatron.core.fusions.fused_layer_norm import fused_norm  # noqa: E402
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce  # noqa: E402
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

TOKENS, HIDDEN, FFN, VOCAB = 1024, 256, 1024, 8192
EXPERTS, TOPK = 8, 2  # MoE rows: 8 experts, top-2 (fused on CPU runs the same code as unfused: see docs/kernels.md)


def _moe_routing(logits, fused=False):
    """Router probabilities plus the aux-loss scores (``--moe-router-fusion``), summed into one output."""
    probs, _ = moe_utils.topk_routing_with_score_function(logits, TOPK, fused=fused)
    _, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, TOPK, "softmax", fused=fused)
    return probs.sum(-1) + scores.sum(-1)


_MOE_EXPERTS = torch.arange(TOKENS * TOPK).view(-1, TOPK) % EXPERTS  # every expert equally loaded
_MOE_MAP = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, _MOE_EXPERTS, True)


def _moe_permute(tokens, probs, fused=False):
    """permute with probabilities, then unpermute weighted by them (``--moe-permute-fusion``)."""
    permuted, _, mapping, _, _ = moe_utils.permute(tokens, _MOE_MAP, probs, TOKENS * TOPK, fused=fused)
    return moe_utils.unpermute(permuted, mapping, tokens.shape, probs, _MOE_MAP, fused=fused)


SEQ, MICRO_BATCH, HEADS, HIDDEN_DROPOUT = 256, 4, 8, 0.1


def _swiglu_unfused(y):
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


def _gelu_unfused(y, bias):
    return F.gelu(y + bias)


def _ce_compiled_body():
    stats = torch.compile(fused_cross_entropy.cross_entropy_statistics, dynamic=False)
    back = torch.compile(fused_cross_entropy.cross_entropy_backward, dynamic=False)

    class _Compiled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target):
            row_max, sum_exp, target_logit = stats(logits, target, 0)
            ctx.save_for_backward(logits, target, row_max, sum_exp)
            return torch.log(sum_exp) + row_max - target_logit

        @staticmethod
        def backward(ctx, grad_output):
            logits, target, row_max, sum_exp = ctx.saved_tensors
            return back(logits, target, row_max, sum_exp, grad_output.contiguous(), 0), None

    return _Compiled.apply


def _cases():
    """name -> (inputs factory, {variant: fn})."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return lambda: torch.randn(*shape, generator=g).requires_grad_()

    target = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    norm_ref = {"LayerNorm": F.layer_norm, "RMSNorm": lambda x, s, w, b, eps: F.rms_norm(x, s, w, eps)}
    cases = {
        "swiglu (no bias)": (
            [randn(TOKENS, 2 * FFN)],
            {
                "unfused": _swiglu_unfused,
                "fused eager": lambda y: fused_bias_swiglu.bias_swiglu_impl(y, None),
                "compiled": torch.compile(_swiglu_unfused, dynamic=False),
            },
        ),
        "bias + gelu": (
            [randn(TOKENS, FFN), randn(FFN)],
            {
                "unfused": _gelu_unfused,
                "fused eager": lambda y, b: fused_bias_gelu.bias_gelu_impl(y, b),
                "compiled": torch.compile(lambda y, b: fused_bias_gelu.bias_gelu(b, y), dynamic=False),
            },
        ),
        "cross entropy": (
            [randn(TOKENS, VOCAB)],
            {
                "unfused": lambda x: vocab_parallel_cross_entropy(x, target),
                "fused eager": lambda x: fused_cross_entropy.fused_vocab_parallel_cross_entropy(x, target, None),
                "compiled": (lambda f: lambda x: f(x, target))(_ce_compiled_body()),
            },
        ),
        "moe routing": (
            [randn(TOKENS, EXPERTS)],
            {
                "unfused": _moe_routing,
                "fused eager": lambda x: _moe_routing(x, fused=True),
                "compiled": torch.compile(_moe_routing, dynamic=False),
            },
        ),
        "moe permute": (
            [randn(TOKENS, HIDDEN), randn(TOKENS, EXPERTS)],
            {
                "unfused": _moe_permute,
                "fused eager": lambda x, p: _moe_permute(x, p, fused=True),
                "compiled": torch.compile(_moe_permute, dynamic=False),
            },
        ),
    }
    for norm, ref in norm_ref.items():

        def unfused(x, w, b, ref=ref):
            return ref(x, (HIDDEN,), w, b, 1e-5)

        cases[norm] = (
            [randn(TOKENS, HIDDEN), randn(HIDDEN), randn(HIDDEN)],
            {
                "unfused": unfused,
                "fused eager": lambda x, w, b, norm=norm: fused_norm(x, w, b, 1e-5, norm),
                "compiled": torch.compile(unfused, dynamic=False),
            },
        )
    cases.update(_softmax_and_dropout_cases(randn))
    cases.update(_wgrad_cases(g))
    return cases


def _softmax_and_dropout_cases(randn):
    """The attention softmax (causal, scores ``[b, heads, s, s]`` scaled first as DotProductAttention does) and
    bias + dropout + add (``[s, b, h]``, Megatron's default hidden dropout 0.1)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    def softmax(fusion):
        module = fused_softmax.FusedScaleMaskSoftmax(
            False, False, AttnMaskType.causal, fusion, attention_mask_func, True, None
        )
        return lambda x: module(x * 0.125, None)

    compiled_softmax = torch.compile(
        lambda x: fused_softmax.scaled_masked_softmax(x * 0.125, None, 1.0, True), dynamic=False
    )
    compiled_bda = torch.compile(
        lambda x, b, r: fused_bias_dropout._bias_dropout_add_func((x, b), r, HIDDEN_DROPOUT, True), dynamic=False
    )

    def bda(fused):
        fn = fused_bias_dropout.get_bias_dropout_add(True, fused)
        return lambda x, b, r: fn((x, b), r, HIDDEN_DROPOUT)

    return {
        "masked softmax": (
            [randn(MICRO_BATCH, HEADS, SEQ, SEQ)],
            {"unfused": softmax(False), "fused eager": softmax(True), "compiled": compiled_softmax},
        ),
        "bias+dropout+add": (
            [randn(SEQ, MICRO_BATCH, HIDDEN), randn(HIDDEN), randn(SEQ, MICRO_BATCH, HIDDEN)],
            {"unfused": bda(False), "fused eager": bda(True), "compiled": compiled_bda},
        ),
    }


def _wgrad_cases(g) -> dict:
    """A linear layer's weight with an fp32 ``main_grad`` and DDP's hook: its backward (weight gradient only, the
    graph kept), unfused and fused."""

    def case(rows, cols, dtype):
        weight = torch.nn.Parameter(torch.randn(rows, cols, generator=g).to(dtype))
        weight.main_grad = torch.zeros(rows, cols)
        weight.grad_added_to_main_grad = False

        def into_main_grad(param):  # what DistributedDataParallel's hook does
            if not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad)
            param.grad = None

        weight.register_post_accumulate_grad_hook(into_main_grad)
        x = torch.randn(TOKENS, cols, generator=g).to(dtype)
        grad = torch.randn(TOKENS, rows, generator=g).to(dtype)

        def backward(fusion):
            out = linear_with_grad_accumulation_and_async_allreduce(x, weight, None, fusion, False, False)
            return lambda: out.backward(grad, retain_graph=True)

        return [], {"unfused": backward(False), "fused eager": backward(True)}

    return {
        "wgrad accum ffn": case(FFN, HIDDEN, torch.float32),
        "wgrad accum output": case(VOCAB, HIDDEN, torch.float32),
        "wgrad accum bf16": case(FFN, HIDDEN, torch.bfloat16),
    }


def _step(fn, inputs):
    out = fn(*inputs)
    if out is not None:  # None: fn ran its backward itself
        out.backward(torch.ones_like(out))


def run(rounds: int, reps: int, only: list | None = None) -> dict:
    results = {}
    for name, (factories, variants) in _cases().items():
        if only and not any(word in name for word in only):
            continue
        inputs = [make() for make in factories]
        compile_s = time.perf_counter()
        if "compiled" in variants:
            _step(variants["compiled"], inputs)
        compile_s = time.perf_counter() - compile_s if "compiled" in variants else float("nan")
        for fn in variants.values():
            _step(fn, inputs)  # warm-up
        times = {variant: [] for variant in variants}
        for _ in range(rounds):
            for variant, fn in variants.items():
                start = time.perf_counter()
                for _ in range(reps):
                    _step(fn, inputs)
                times[variant].append((time.perf_counter() - start) / reps * 1e3)
        results[name] = {variant: statistics.median(t) for variant, t in times.items()}
        results[name]["compile_s"] = compile_s
        print(f"  measured {name}", file=sys.stderr, flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", nargs="+", help="time only the fusions whose names contain one of these words")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = run(args.rounds, args.reps, args.only)
    print(f"\nfwd+bwd ms per call, median of {args.rounds} rounds, {args.threads} threads, fp32")
    header = ("unfused", "fused eager", "compiled", "eager/unf", "comp/unf", "compile s")
    print(f"{'fusion':<18} " + " ".join(f"{h:>11}" for h in header))
    for name, r in results.items():
        compiled = r.get("compiled", float("nan"))
        print(
            f"{name:<18} {r['unfused']:>11.2f} {r['fused eager']:>11.2f} {compiled:>11.2f} "
            f"{r['fused eager'] / r['unfused']:>10.2f}x {compiled / r['unfused']:>10.2f}x {r['compile_s']:>11.1f}"
        )
    out = REPO_ROOT / "benchmarks" / "results" / "fusions.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
