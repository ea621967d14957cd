"""Run the MoE Triton kernels (``moe_permute_fusion``, ``moe_router_fusion``) in Triton's CPU interpreter against
``moe_utils``' PyTorch code, forward and backward, fp32 and bf16.

Started as a subprocess by test_moe_fusions.py, like interpreter_checks.py (TRITON_INTERPRET must be set before
Triton is imported). Each case calls ``moe_utils`` with ``fused=True`` and checks that the kernel ran (the permute
returns a row map; the routing counts its kernel calls), so a silent fall-back to the PyTorch code fails. Prints one
JSON object mapping each case ``name/dtype`` to None (match) or the mismatch message.
"""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.core.fusions.kernels import moe_permute, moe_router  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from tests.unit_tests.models.gpt_test_helpers import relative_error  # noqa: E402

TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
TOKENS, HIDDEN, EXPERTS = 7, 24, 4

_router_calls, _permute_calls = [], []
_topk_forward, _scatter_rows = moe_router.topk_forward, moe_permute.scatter_rows
moe_router.topk_forward = lambda *args: _router_calls.append(1) or _topk_forward(*args)
moe_permute.scatter_rows = lambda *args, **kwargs: _permute_calls.append(1) or _scatter_rows(*args, **kwargs)


def _compare(fn, inputs, dtype):
    """``fn(fused, *inputs)``'s outputs and input gradients, fused (inputs at ``dtype``) vs PyTorch (the same
    values in fp32). Bool outputs (routing maps) must be equal."""
    ours = [x.detach().to(dtype).requires_grad_() for x in inputs]
    ref = [x.detach().to(dtype).float().requires_grad_() for x in inputs]
    out, expected = fn(True, *ours), fn(False, *ref)
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(e.shape, generator=generator) if e.is_floating_point() else None for e in expected]
    for i, (mine, theirs) in enumerate(zip(out, expected)):
        if not theirs.is_floating_point():
            assert torch.equal(mine, theirs), f"output {i}: {mine} != {theirs}"
            continue
        torch.testing.assert_close(mine.float(), theirs, **TOLERANCES[dtype], msg=lambda m: f"output {i}: {m}")
    pairs = [(o, g) for o, g in zip(out, grads) if g is not None and o.requires_grad]
    torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
    pairs = [(e, g) for e, g in zip(expected, grads) if g is not None and e.requires_grad]
    torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
    for i, (mine, theirs) in enumerate(zip(ours, ref)):
        if theirs.grad is None:  # an input the outputs do not depend on (probs, unweighted)
            assert mine.grad is None or not mine.grad.any(), f"grad {i}: nonzero where PyTorch has none"
        else:
            scale = theirs.grad.abs().max().clamp_min(1.0)
            torch.testing.assert_close(
                mine.grad.float() / scale, theirs.grad / scale, **TOLERANCES[dtype], msg=lambda m: f"grad {i}: {m}"
            )


def _routing_map(generator, topk=2):
    logits = torch.randn(TOKENS, EXPERTS, generator=generator)
    indices = logits.topk(topk, dim=1).indices
    return torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, indices, True)


def _permute_case(routing_map, with_probs, capacity=None):
    """permute -> a per-row scaling standing in for the experts -> unpermute (weighted by probs when given)."""
    drop_and_pad = capacity is not None
    num_out = EXPERTS * capacity if drop_and_pad else int(routing_map.sum())
    row_scale = torch.linspace(0.5, 2.0, num_out).unsqueeze(-1)

    def fn(fused, tokens, probs):
        permuted, permuted_probs, mapping, _, _ = moe_utils.permute(
            tokens, routing_map, probs if with_probs else None, num_out, fused=fused, drop_and_pad=drop_and_pad
        )
        assert not fused or mapping.dim() == 2, "the fused permute ran PyTorch's code, not the kernel"
        restored = moe_utils.unpermute(
            permuted * row_scale.to(permuted.dtype),
            mapping,
            tokens.shape,
            probs=probs if with_probs else None,
            routing_map=routing_map,
            fused=fused,
            drop_and_pad=drop_and_pad,
        )
        return [permuted, restored] + ([permuted_probs] if with_probs else [])

    return fn


def _stable_topk(choice, topk):
    """Top-k indices, the lowest index first among equal values (the kernel's rule; torch.topk leaves it open)."""
    return torch.sort(choice, dim=1, descending=True, stable=True).indices[:, :topk]


def _router_case(topk, score_function, pre_softmax=False, scaling=None, bias=None):
    def fn(fused, logits):
        kwargs = dict(use_pre_softmax=pre_softmax, scaling_factor=scaling, score_function=score_function)
        if fused:
            calls = len(_router_calls)
            out = moe_utils.topk_routing_with_score_function(logits, topk, expert_bias=bias, fused=True, **kwargs)
            assert len(_router_calls) == calls + 1, "the fused routing ran PyTorch's code, not the kernel"
            return list(out)
        x = logits.detach().float()
        if score_function == "softmax":
            choice = torch.softmax(x, -1) if pre_softmax else x
        else:
            choice = torch.sigmoid(x) if score_function == "sigmoid" else F.softplus(x).sqrt()
            choice = choice if bias is None else choice + bias
        indices = _stable_topk(choice, topk)
        return list(
            moe_utils.topk_routing_with_score_function(
                logits, topk, expert_bias=bias, precomputed_indices=indices, **kwargs
            )
        )

    return fn


def _aux_case(topk, score_function):
    def fn(fused, logits):
        if fused:
            calls = len(_router_calls)
            routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, topk, score_function, True)
            assert len(_router_calls) == calls + 1, "the fused aux scores ran PyTorch's code, not the kernel"
            return [scores, routing_map]
        _, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, topk, score_function)
        indices = _stable_topk(scores.detach(), topk)
        return [scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)]

    return fn


def _cases():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(TOKENS, HIDDEN, generator=g)
    probs = torch.rand(TOKENS, EXPERTS, generator=g)
    routing_map = _routing_map(g)
    yield "permute_probs", _permute_case(routing_map, True), (tokens, probs)
    yield "permute", _permute_case(routing_map, False), (tokens, probs)
    # Capacity 3 of 7 tokens x top-2 over 4 experts: crowded experts drop tokens, the others pad with unrouted ones.
    skewed = routing_map.clone()
    skewed[:, 0] = True
    yield "permute_drop_and_pad", _permute_case(skewed, True, capacity=3), (tokens, probs)
    logits = torch.randn(TOKENS, 8, generator=g) * 2
    bias = torch.randn(8, generator=g) * 0.1
    ties = torch.randint(-2, 3, (TOKENS, 8), generator=g).float()  # many equal logits in each row
    yield "router_softmax", _router_case(2, "softmax", scaling=2.5), (logits,)
    yield "router_softmax_ties", _router_case(3, "softmax"), (ties,)
    yield "router_pre_softmax", _router_case(3, "softmax", pre_softmax=True), (logits,)
    yield "router_sigmoid_bias", _router_case(2, "sigmoid", scaling=1.5, bias=bias), (logits,)
    yield "router_sigmoid_ties", _router_case(2, "sigmoid"), (ties,)
    yield "router_sqrtsoftplus_top1", _router_case(1, "sqrtsoftplus"), (logits * 8,)
    yield "aux_scores_softmax", _aux_case(2, "softmax"), (logits,)
    yield "aux_scores_sigmoid", _aux_case(2, "sigmoid"), (ties,)
    yield "aux_scores_sqrtsoftplus", _aux_case(3, "sqrtsoftplus"), (logits * 8,)


# An MoE layer (router, dispatcher, experts, aux loss) with both fusions on against the same layer with them off.
LAYER_CASES = {
    "layer_alltoall_capacity": dict(
        moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
    ),
    "layer_allgather_sigmoid_bias": dict(
        moe_token_dispatcher_type="allgather",
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.0,
    ),
}


def _layer_run(overrides, fused):
    from tests.unit_tests.transformer.moe.moe_test_helpers import build_moe_layer, fresh_moe_state, global_batch
    from tests.unit_tests.transformer.moe.moe_test_helpers import moe_config

    fresh_moe_state()
    layer = build_moe_layer(moe_config(moe_permute_fusion=fused, moe_router_fusion=fused, **overrides))
    (x,), (w,) = global_batch(1)
    x.requires_grad_()
    output, _ = layer(x)
    (output * w).sum().backward()
    return [output.detach(), x.grad] + [p.grad for _, p in sorted(layer.named_parameters())]


def layer_errors():
    """``{case: None or the mismatch}`` for each of LAYER_CASES, in one single-rank gloo process group."""
    import tempfile

    import torch.distributed as dist

    from megatron.core import parallel_state

    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    results = {}
    for name, overrides in LAYER_CASES.items():
        try:
            calls = len(_router_calls), len(_permute_calls)
            fused = _layer_run(overrides, True)
            assert len(_router_calls) > calls[0] and len(_permute_calls) > calls[1], "a kernel did not run"
            for i, (mine, theirs) in enumerate(zip(fused, _layer_run(overrides, False))):
                # Relative to the tensor's norm: the routed experts' share of the output is small at init.
                error = relative_error(mine, theirs)
                assert error < 1e-5, f"tensor {i} (output, input grad, parameter grads by name): relative error {error}"
            results[f"{name}/float32"] = None
        except Exception as error:  # noqa: BLE001 - every failure is reported to the test, by case
            results[f"{name}/float32"] = f"{type(error).__name__}: {error}"
    dist.destroy_process_group()
    os.unlink(store.name)
    return results


def main():
    results = layer_errors()
    for name, fn, inputs in _cases():
        for dtype in TOLERANCES:
            case = f"{name}/{str(dtype).removeprefix('torch.')}"
            try:
                _compare(fn, inputs, dtype)
                results[case] = None
            except Exception as error:  # noqa: BLE001 - every failure is reported to the test, by case
                results[case] = f"{type(error).__name__}: {error}"
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
