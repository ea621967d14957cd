"""Gradient-accumulation fusion on CPU: ``wgrad_gemm_accum`` against a float64 reference (fp32 and bf16 inputs, fp32
and bf16 ``main_grad``), and GPT + DDP with the fusion on against off (TP2 and DP2 layouts, with and without the
distributed optimizer, two micro-batches): the same losses, gradients in ``main_grad`` and weights after a step.
The Triton kernel is checked in test_triton_kernels.py."""

import contextlib

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.fusions.fused_weight_gradient import wgrad_gemm_accum
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import layers
from tests.unit_tests.distributed import fsdp_test_helpers as fsdp
from tests.unit_tests.models.gpt_test_helpers import assert_close_dicts, batch, build_model
from tests.unit_tests.test_utilities import run_distributed


@pytest.mark.parametrize(
    "dtype,main_dtype,tolerance",
    [
        (torch.float32, torch.float32, 1e-6),
        (torch.bfloat16, torch.float32, 1e-6),  # summed in fp32: only the fp32 rounding of the sum
        (torch.bfloat16, torch.bfloat16, 1e-2),  # one rounding to bf16 when stored
    ],
)
def test_wgrad_gemm_accum_adds_into_main_grad(dtype, main_dtype, tolerance):
    g = torch.Generator().manual_seed(0)
    x, go = torch.randn(3, 7, 5, generator=g).to(dtype), torch.randn(3, 7, 11, generator=g).to(dtype)
    start = torch.randn(11, 5, generator=g)
    main_grad = start.to(main_dtype)
    expected = main_grad.double() + go.double().reshape(-1, 11).t() @ x.double().reshape(-1, 5)
    storage = main_grad.data_ptr()
    wgrad_gemm_accum(x, go, main_grad)
    assert main_grad.data_ptr() == storage and main_grad.dtype == main_dtype  # in place
    error = ((main_grad.double() - expected).norm() / expected.norm()).item()
    assert error <= tolerance, f"relative error {error:.1e}"


def _step(tp, distributed_optimizer, fusion, variant="llama"):
    """One step of two micro-batches of a GPT wrapped in DDP (Llama: tied embeddings, whose output layer gets a zero
    placeholder gradient; GPT-2: untied): the losses, every parameter's main_grad after finalize_model_grads, the
    weights after the step, and how often the fused GEMM ran."""
    model = build_model(tp, False, variant, config_overrides={"gradient_accumulation_fusion": fusion})
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed_optimizer), [ddp]
    )
    calls, restore = _counting_fused_calls()
    try:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        dp_rank = torch.distributed.get_rank(ddp.dp_cp_group)
        losses = []
        for micro in range(2):
            tokens, position_ids, labels = batch(seed=10 * dp_rank + micro)
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = ddp(tokens, position_ids, None, labels=labels).mean() / 2
                loss.backward()
            losses.append(loss.detach())
        finalize_model_grads([ddp])
        grads = {name: param.main_grad.clone() for name, param in model.named_parameters()}
        optimizer.step()
    finally:
        restore()
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    return torch.stack(losses), grads, weights, len(calls)


def _counting_fused_calls():
    calls, original = [], layers.wgrad_gemm_accum
    layers.wgrad_gemm_accum = lambda *args: (calls.append(1), original(*args))[1]
    return calls, lambda: setattr(layers, "wgrad_gemm_accum", original)


def _megatron_fsdp_step(fusion):
    """The same under Megatron FSDP at DP2 with parameters, gradients and optimizer state sharded: main_grad is a
    full gradient tensor that exists only while the unit's backward runs."""
    model = build_model(1, False, "llama", config_overrides={"gradient_accumulation_fusion": fusion})
    wrapped = fsdp.wrap(model, "optim_grads_params")
    optimizer = fsdp.optimizer_for(wrapped)
    grads = {}
    calls, restore = _counting_fused_calls()
    try:
        loss = fsdp.train_step(
            wrapped, optimizer, 0, microbatches=2, after_grads=lambda w: grads.update(fsdp.reduced_gradients(w))
        )
    finally:
        restore()
    return torch.tensor([loss]), grads, fsdp.full_weights(wrapped), len(calls)


def _fused_vs_unfused():
    runs = {
        (tp, dist_opt, "llama"): (_step(tp, dist_opt, True), _step(tp, dist_opt, False))
        for tp in (1, 2)  # DP2, then TP2
        for dist_opt in (False, True)
    }
    runs[(2, False, "gpt2")] = (_step(2, False, True, "gpt2"), _step(2, False, False, "gpt2"))
    runs[(1, "megatron_fsdp", "llama")] = (_megatron_fsdp_step(True), _megatron_fsdp_step(False))
    return runs


@pytest.fixture(scope="module")
def runs():
    return run_distributed(2, _fused_vs_unfused)


@pytest.mark.parametrize(
    "tp,distributed_optimizer,variant",
    (
        (1, False, "llama"),
        (1, True, "llama"),
        (2, False, "llama"),
        (2, True, "llama"),
        (2, False, "gpt2"),
        (1, "megatron_fsdp", "llama"),
    ),
    ids=("dp2-ddp", "dp2-distopt", "tp2-ddp", "tp2-distopt", "tp2-ddp-untied", "dp2-megatron-fsdp"),
)
def test_gpt_ddp_fused_equals_unfused(runs, tp, distributed_optimizer, variant):
    for rank, results in enumerate(runs):
        (losses, grads, weights, calls), (ref_losses, ref_grads, ref_weights, ref_calls) = results[
            (tp, distributed_optimizer, variant)
        ]
        # Every linear layer's weight gradient took the fused GEMM (2 layers x 4 linears + output, 2 micro-batches).
        assert calls == 18 and ref_calls == 0, (calls, ref_calls)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
        what = f"rank {rank}"
        assert_close_dicts(grads, ref_grads, tolerance=1e-6, what=f"{what} main_grad")
        # Including the tied embedding, whose main_grad gets the output layer's part from the fused GEMM and the
        # lookup's through weight.grad.
        assert_close_dicts(weights, ref_weights, tolerance=1e-6, what=f"{what} weights")
