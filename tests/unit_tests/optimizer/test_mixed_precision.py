"""bf16 and fp16 models with fp32 main parameters train like the fp32 model; fp16 overflow skips steps and the
dynamic loss scale backs off and recovers."""

import math

import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import DynamicGradScaler, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from tests.unit_tests.distributed.ddp_test_helpers import (
    TinyLM,
    max_relative_error,
    model_config,
    train_data_parallel,
    train_reference,
    weights,
    wrap,
)
from tests.unit_tests.test_utilities import Utils, run_distributed

STEPS, GLOBAL_BATCH, MICROBATCHES = 3, 8, 2
# Rounding a weight to bf16 (8 significant bits) / fp16 (11 bits) costs 2^-9 / 2^-12 relative; half-precision
# activations also perturb the gradients, and Adam turns a flipped sign of a tiny gradient into a full lr-sized
# step the other way. Hence a few times the rounding error, and every tensor's update must agree with fp32's to
# within half of its size.
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}


def _opt_config(precision=None, distributed=False, **overrides) -> OptimizerConfig:
    flags = {"bf16": precision == "bf16", "fp16": precision == "fp16"}
    return OptimizerConfig(
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.5,
        use_distributed_optimizer=distributed,
        initial_loss_scale=1024,
        **flags,
        **overrides,
    )


def _half_precision_matches_fp32_master():
    Utils.initialize_model_parallel()
    reference = TinyLM()
    initial = weights(reference)
    train_reference(reference, _opt_config(), STEPS, GLOBAL_BATCH, MICROBATCHES)
    expected = weights(reference)
    results = []
    for precision in ("bf16", "fp16"):
        for distributed in (False, True):
            config = model_config(**{precision: True})
            model = wrap(
                Float16Module(config, TinyLM()),
                DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
                config,
            )
            optimizer = get_megatron_optimizer(_opt_config(precision, distributed), [model])
            norms = train_data_parallel(model, optimizer, STEPS, GLOBAL_BATCH, MICROBATCHES)
            final = {k: v.float() for k, v in model.state_dict().items()}
            results.append(
                {
                    "precision": precision,
                    "optimizer": type(optimizer).__name__,
                    "model_dtypes": {p.dtype for p in model.parameters()},
                    "main_dtypes": {p.dtype for p in optimizer.get_parameters()},
                    "grad_dtypes": {b.grad_data.dtype for b in model.buffers},
                    "all_steps_taken": all(n is not None for n in norms),
                    "error": max_relative_error(final, expected),
                    "error_vs_update": max(
                        max_relative_error({k: final[k]}, {k: expected[k]})
                        / max_relative_error({k: expected[k]}, {k: initial[k]})
                        for k in expected
                    ),
                }
            )
    return results


def test_bf16_and_fp16_train_like_fp32_with_fp32_main_params():
    for rank_results in run_distributed(2, _half_precision_matches_fp32_master):
        for result in rank_results:
            precision = result["precision"]
            dtype = torch.bfloat16 if precision == "bf16" else torch.float16
            assert result["optimizer"] in ("Float16OptimizerWithFloat16Params", "DistributedOptimizer")
            assert result["model_dtypes"] == {dtype}
            assert result["main_dtypes"] == {torch.float32}
            assert result["grad_dtypes"] == {torch.float32}
            assert result["all_steps_taken"]
            assert result["error"] < TOLERANCE[precision], f"{precision} {result['optimizer']}: {result['error']:.2e}"
            assert result["error_vs_update"] < 0.5, f"{precision} {result['optimizer']}: {result['error_vs_update']}"


def _overflow_skips_and_recovers():
    Utils.initialize_model_parallel()
    results = {}
    for distributed in (False, True):
        config = model_config(fp16=True)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
        model = wrap(Float16Module(config, TinyLM()), ddp_config, config)
        optimizer = get_megatron_optimizer(_opt_config("fp16", distributed, hysteresis=1, loss_scale_window=2), [model])
        scales, snapshots = [], []

        def overflow_on_step_one(step, loss):
            scales.append(optimizer.get_loss_scale().item())
            snapshots.append(weights(model.module))
            return loss * math.inf if step == 1 else loss

        norms = train_data_parallel(model, optimizer, 5, GLOBAL_BATCH, 1, inject=overflow_on_step_one)
        model.state_dict()
        after_skip_unchanged = max_relative_error(snapshots[2], snapshots[1]) == 0.0
        main_params_finite = all(torch.isfinite(p).all() for p in optimizer.get_parameters())
        results[distributed] = (norms, scales, after_skip_unchanged, main_params_finite)
    return results


def test_fp16_overflow_skips_the_step_backs_off_and_grows_again():
    for rank_results in run_distributed(2, _overflow_skips_and_recovers):
        for distributed, (norms, scales, unchanged, finite) in rank_results.items():
            assert norms[1] is None and all(n is not None for i, n in enumerate(norms) if i != 1), norms
            assert unchanged, "a skipped step must leave the weights untouched"
            assert finite
            # 1024 -> overflow halves it (hysteresis 1) -> two clean steps double it back (window 2).
            assert scales == [1024.0, 1024.0, 512.0, 512.0, 1024.0], (distributed, scales)


def test_dynamic_scaler_hysteresis_floor_growth_and_state_round_trip():
    scaler = DynamicGradScaler(
        initial_scale=8.0, min_scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2
    )
    history = []
    for found_inf in (True, True, True, True, False, False, False, True):
        scaler.update(found_inf)
        history.append(scaler.scale.item())
    # Hysteresis 2: the first overflow only spends the budget; later ones halve it down to the floor of 2.
    # Three clean steps double it and refill the budget, so the next overflow does not halve it.
    assert history == [8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 4.0, 4.0]
    assert scaler.inv_scale.item() == 0.25

    restored = DynamicGradScaler(
        initial_scale=2.0, min_scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2
    )
    restored.load_state_dict(scaler.state_dict())
    for found_inf in (True, True):
        scaler.update(found_inf)
        restored.update(found_inf)
    assert restored.scale.item() == scaler.scale.item() == 2.0
    with pytest.raises(KeyError, match=r"lacks \['growth_tracker', 'hysteresis_tracker'\]"):
        restored.load_state_dict({"scale": torch.tensor([4.0])})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(initial_scale=0.0), "initial loss scale must be positive, got 0.0"),
        (dict(min_scale=16.0), "min loss scale must be positive and at most the initial scale 8.0, got 16.0"),
        (dict(growth_factor=1.0), "growth factor must be > 1, got 1.0"),
        (dict(backoff_factor=1.5), r"backoff factor must be in \(0, 1\), got 1.5"),
        (dict(growth_interval=0), "growth interval\\) must be positive, got 0"),
        (dict(hysteresis=0), "hysteresis must be positive, got 0"),
    ],
)
def test_dynamic_scaler_rejects_bad_settings(kwargs, message):
    settings = dict(
        initial_scale=8.0, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2
    )
    with pytest.raises(ValueError, match=message):
        DynamicGradScaler(**{**settings, **kwargs})


def _float16_module_casts_inputs_and_outputs():
    Utils.initialize_model_parallel()

    class Echo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(2))

        def forward(self, values, ids):
            return values * self.scale, ids, values.dtype

    wrapped = Float16Module(model_config(bf16=True), Echo())
    out, ids, seen = wrapped(torch.ones(2), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="exactly one of config.fp16 / config.bf16"):
        Float16Module(model_config(), Echo())
    return seen, out.dtype, ids.dtype, wrapped.module.scale.dtype, sorted(wrapped.state_dict())


def test_float16_module_runs_the_model_in_half_and_returns_fp32():
    seen, out_dtype, ids_dtype, param_dtype, keys = run_distributed(1, _float16_module_casts_inputs_and_outputs)[0]
    assert (seen, out_dtype, ids_dtype, param_dtype) == (torch.bfloat16, torch.float32, torch.int64, torch.bfloat16)
    assert keys == ["scale"], "checkpoints of a wrapped model keep the model's own keys"
