"""The FP8 linear against a hand-written emulation built on torchao's quantisers, and FP8 training of a tiny GPT:
it tracks the unquantised run, differs from it, gives the same losses at TP2 + SP as at TP1, and its delayed-scaling
state survives a distributed checkpoint."""

import warnings

import pytest
import torch

from megatron.core.fp8.quantization import E4M3, E5M2
from megatron.core.fp8.recipe import Fp8ScalingRecipe, fp8_autocast
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.fp8_linear import fp8_linear
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.unit_tests.test_utilities import run_distributed

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("torchao")
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.blockwise_fp8_training.kernels import (
        torch_blockwise_scale_act_quant_lhs,
        torch_blockwise_scale_weight_quant,
    )
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx


# ---- the reference: each GEMM operand quantised along its contraction dimension by torchao, then an fp32 GEMM ----


def _tensorwise(t, dtype):
    scale = tensor_to_scale(t, dtype)
    return to_fp8_saturated(t * scale, dtype).float() / scale


def _mx(t, dtype):
    scale, data = to_mx(t.contiguous(), dtype, 32, ScaleCalculationMode.RCEIL)
    return to_dtype(data, scale, dtype, 32, torch.float32)


def _tiles(t, dtype, weight):
    t = t.contiguous()
    if weight:
        data, scale_inv = torch_blockwise_scale_weight_quant(t, 128, dtype)
        return data.float() * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    data, scale_inv = torch_blockwise_scale_act_quant_lhs(t, 128, dtype)
    return data.float() * scale_inv.repeat_interleave(128, 1)


def _emulate(recipe, fp8_format, x, w, b, dy, fp8_wgrad=True):
    """(y, dx, dw, db) of ``y = x @ w.T + b`` with every GEMM operand quantised as the recipe says."""
    bwd = E5M2 if fp8_format == "hybrid" else E4M3
    x, dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if recipe == "tensorwise":
        qx, qw, qdy = _tensorwise(x, E4M3), _tensorwise(w, E4M3), _tensorwise(dy, bwd)
        y, dx, dw = qx @ qw.t(), qdy @ qw, qdy.t() @ qx
    elif recipe == "mxfp8":
        y = _mx(x, E4M3) @ _mx(w, E4M3).t()
        dx = _mx(dy, bwd) @ _mx(w.t(), E4M3).t()
        dw = _mx(dy.t(), bwd) @ _mx(x.t(), E4M3).t()
    else:
        y = _tiles(x, E4M3, False) @ _tiles(w, E4M3, True).t()
        dx = _tiles(dy, bwd, False) @ _tiles(w.t(), E4M3, True).t()
        dw = _tiles(dy.t(), bwd, False) @ _tiles(x.t(), E4M3, False).t()
    if not fp8_wgrad:
        dw = dy.t() @ x
    return y + b, dx, dw, dy.sum(0)


@pytest.mark.parametrize(
    "name, fp8_format, recipe, fp8_wgrad",
    [
        ("tensorwise-hybrid", "hybrid", "tensorwise", True),
        ("tensorwise-e4m3", "e4m3", "tensorwise", True),
        ("mxfp8-hybrid", "hybrid", "mxfp8", True),
        ("blockwise-hybrid", "hybrid", "blockwise", True),
        ("tensorwise-hybrid-no-fp8-wgrad", "hybrid", "tensorwise", False),
    ],
)
def test_fp8_linear_matches_the_emulation(name, fp8_format, recipe, fp8_wgrad):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, 128, generator=generator, requires_grad=True)
    w = (torch.randn(256, 128, generator=generator) * 0.05).requires_grad_()
    b = torch.randn(256, generator=generator, requires_grad=True)
    dy = torch.randn(2, 64, 256, generator=generator) * 1e-3
    fp8 = Fp8ScalingRecipe(fp8_format=fp8_format, recipe=recipe, fp8_wgrad=fp8_wgrad)
    y = fp8_linear(x, w, b, recipe=fp8)
    y.backward(dy)
    expected = _emulate(recipe, fp8_format, x.detach(), w.detach(), b.detach(), dy, fp8_wgrad)
    got = (y.reshape(-1, 256), x.grad.reshape(-1, 128), w.grad, b.grad)
    for what, actual, reference in zip(("y", "dx", "dw", "db"), got, expected):
        # Only the dequantisation's rounding differs (the reference divides by the scale, we multiply by its
        # float32 reciprocal), so the results agree to float32 precision of the largest entry.
        error = (actual - reference).abs().max() / reference.abs().max()
        assert error < 1e-5, f"{name}: {what} differs from the emulation by {error:.2e} of its largest entry"
    assert not torch.allclose(y.detach(), x.detach() @ w.detach().t() + b.detach(), rtol=1e-4)  # FP8 did run


def test_parallel_linears_run_fp8_only_inside_the_region():
    config = ModelParallelConfig(perform_initialization=False)
    column = ColumnParallelLinear(128, 64, config=config, init_method=torch.nn.init.zeros_)
    row = RowParallelLinear(
        64,
        128,
        config=config,
        init_method=torch.nn.init.zeros_,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    with torch.no_grad():
        column.weight.copy_(torch.randn(64, 128) * 0.1)
        row.weight.copy_(torch.randn(128, 64) * 0.1)
    x = torch.randn(8, 128)
    high = row(column(x)[0])[0]
    with fp8_autocast(Fp8ScalingRecipe(recipe="tensorwise")):
        low = row(column(x)[0])[0]
    qx = _tensorwise(x, E4M3)
    h = qx @ _tensorwise(column.weight.detach(), E4M3).t() + column.bias.detach()
    torch.testing.assert_close(low.detach(), _tensorwise(h, E4M3) @ _tensorwise(row.weight.detach(), E4M3).t())
    torch.testing.assert_close(row(column(x)[0])[0], high)  # outside the region: high precision again


# ---- a tiny GPT trained in FP8 ---------------------------------------------------------------------------------


STEPS = 4


def _train(tp, sp, recipes, checkpoint_dir=None):
    """Losses of STEPS Adam steps per recipe (None: no FP8) of the same GPT on the same batches; with
    ``checkpoint_dir``, also round-trips the delayed model's state through a distributed checkpoint."""
    from tests.unit_tests.models.gpt_test_helpers import batch, build_model

    results = {}
    for recipe in recipes:
        overrides = {} if recipe is None else {"fp8": "hybrid", "fp8_recipe": recipe, "fp8_amax_history_len": 4}
        model = build_model(tp, sp, "gpt2", config_overrides=overrides)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(STEPS):
            tokens, positions, labels = batch()  # one batch, memorised: the loss falls steadily
            loss = model(tokens, positions, None, labels=labels).mean()
            optimizer.zero_grad()
            loss.backward()
            _finalize_sequence_parallel_grads(model)
            optimizer.step()
            losses.append(loss.item())
        results[recipe] = losses
        if checkpoint_dir is not None and recipe == "delayed":
            results["checkpoint"] = _checkpoint_round_trip(model, overrides, tp, sp, checkpoint_dir)
    return results


def _finalize_sequence_parallel_grads(model):
    """What finalize_model_grads does for these: under SP each rank saw part of the sequence."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


def _checkpoint_round_trip(model, overrides, tp, sp, checkpoint_dir):
    from megatron.core import dist_checkpointing
    from tests.unit_tests.models.gpt_test_helpers import build_model

    qkv = model.decoder.layers[0].self_attention.linear_qkv
    saved = {name: t.clone() for name, t in qkv.get_extra_state().items()}
    dist_checkpointing.save(model.sharded_state_dict(), checkpoint_dir)
    fresh = build_model(tp, sp, "gpt2", config_overrides=overrides)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), checkpoint_dir))
    restored = fresh.decoder.layers[0].self_attention.linear_qkv.get_extra_state()
    return {
        "history_was_recorded": bool((saved["fp8_amax_history"] > 0).all()),
        "restored_equal": all(torch.equal(saved[name], restored[name]) for name in saved),
        "plain_state_dict_has_it": isinstance(model.state_dict()["decoder.layers.0.mlp.linear_fc1._extra_state"], dict),
    }


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fp8_ckpt"))
    return run_distributed(1, _train, 1, False, [None, "tensorwise", "delayed"], directory)[0]


def test_fp8_training_tracks_the_unquantised_run_and_differs_from_it(one_rank):
    baseline = torch.tensor(one_rank[None])
    assert baseline[-1] < baseline[0] - 0.05  # the run learns
    for recipe in ("tensorwise", "delayed"):
        losses = torch.tensor(one_rank[recipe])
        # E4M3 keeps 3 mantissa bits (relative rounding up to 2**-4 per element), but the errors of a GEMM's
        # products are independent and average out over its sums, and this run measures loss differences near
        # 1e-3 relative; 1% is ten times that and still far below the loss drop of these steps (> 1%).
        torch.testing.assert_close(losses, baseline, rtol=1e-2, atol=0, msg=recipe)
        assert (losses - baseline).abs().max() > 1e-5, f"{recipe}: identical to the unquantised run"


def test_delayed_scaling_state_survives_a_distributed_checkpoint(one_rank):
    assert one_rank["checkpoint"] == {
        "history_was_recorded": True,
        "restored_equal": True,
        "plain_state_dict_has_it": True,
    }


def test_tp2_with_sequence_parallelism_equals_tp1(one_rank):
    # Per-tensor amaxes are reduced over the tensor-parallel ranks, so each rank quantises its shard with the scale
    # of the whole tensor, as TP1 does, and the first two losses (the forward pass, then one update from the FP8
    # gradients) agree to float32 precision; without the reduction they differ by ~1e-4 (tensorwise at step 0,
    # delayed at step 1: its first step uses scale 1). Later, a value that differs between layouts in its last
    # float32 bit now and then rounds to the neighbouring FP8 value (2**-4 apart) and Adam carries that on: the runs
    # then stay within 5e-4, below FP8's own deviation from the unquantised run (~1e-3).
    tp2 = run_distributed(2, _train, 2, True, ["tensorwise", "delayed"])
    assert tp2[0] == tp2[1]
    for recipe in ("tensorwise", "delayed"):
        layouts = torch.tensor(tp2[0][recipe]), torch.tensor(one_rank[recipe])
        torch.testing.assert_close(layouts[0][:2], layouts[1][:2], rtol=1e-5, atol=0, msg=str(recipe))
        torch.testing.assert_close(layouts[0], layouts[1], rtol=5e-4, atol=0, msg=str(recipe))


def _hybrid_losses():
    from tests.unit_tests.models.hybrid.hybrid_test_helpers import BATCH, SEQ, VOCAB, build_model

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    losses = []
    for overrides in ({}, {"fp8": "hybrid", "fp8_recipe": "mxfp8"}):
        model = build_model(config_overrides=overrides)
        loss = model(tokens, positions, None, labels=tokens).mean()
        loss.backward()
        losses.append(loss.item())
    return losses


def test_hybrid_mamba_model_trains_in_fp8():
    plain, fp8 = run_distributed(1, _hybrid_losses)[0]
    assert fp8 != plain and abs(fp8 - plain) < 1e-2 * plain


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="torch._scaled_mm's FP8 GEMM needs a CUDA GPU of compute capability 8.9 or newer",
)
def test_scaled_mm_on_an_fp8_gpu_matches_the_cpu_emulation():
    from megatron.core.fp8.quantization import quantize_tensorwise, scaled_matmul

    generator = torch.Generator().manual_seed(5)
    x, w = torch.randn(64, 128, generator=generator), torch.randn(96, 128, generator=generator) * 0.05
    for x_dtype in (E4M3, E5M2):
        qx, qw = quantize_tensorwise(x.cuda(), x_dtype), quantize_tensorwise(w.cuda(), E4M3)
        on_gpu = scaled_matmul(qx, qw, torch.float32).cpu()
        emulated = scaled_matmul(quantize_tensorwise(x, x_dtype), quantize_tensorwise(w, E4M3), torch.float32)
        # Same products, both accumulated in float32; only the summation order differs.
        torch.testing.assert_close(on_gpu, emulated, rtol=1e-5, atol=1e-5)


def test_grouped_gemm_experts_say_they_stay_unquantised():
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import warn_once

    warn_once.cache_clear()
    with pytest.warns(UserWarning, match=r"fp8='hybrid' with moe_grouped_gemm=True: the grouped-GEMM experts are not"):
        TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=2, moe_grouped_gemm=True, fp8="hybrid"
        )
