"""Lion: the published update on numbers worked by hand, DP2 (plain DDP and the distributed optimizer) equal to one
process, its one-tensor state through a distributed-optimizer checkpoint, Lion as Muon's scalar optimizer, and the
flags (``--optimizer lion``, ``--lion-beta1/2``) reaching the optimizer."""

import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.lion import Lion
from megatron.training.model_setup import get_megatron_optimizer_config
from tests.unit_tests.distributed.ddp_test_helpers import (
    TinyLM,
    max_relative_error,
    train_data_parallel,
    train_reference,
    weights,
    wrap,
)
from tests.unit_tests.optimizer.test_precision_aware_optimizer import save_then_resume
from tests.unit_tests.test_utilities import Utils, run_distributed
from tests.unit_tests.training.test_arguments import validated


def test_two_steps_follow_the_published_update():
    # lr 0.1, weight decay 0.1, betas (0.9, 0.99), p = 1, gradients 0.5 then -1:
    # step 1: c = 0.1 * 0.5 > 0, p = 1 * 0.99 - 0.1 = 0.89, m = 0.01 * 0.5 = 0.005
    # step 2: c = 0.9 * 0.005 - 0.1 < 0, p = 0.89 * 0.99 + 0.1 = 0.9811, m = 0.99 * 0.005 - 0.01 = -0.00505
    param = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    optimizer = Lion([param], lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    for grad, (expected_param, expected_momentum) in zip((0.5, -1.0), ((0.89, 0.005), (0.9811, -0.00505))):
        param.grad = torch.tensor([grad], dtype=torch.float64)
        optimizer.step()
        assert param.item() == pytest.approx(expected_param, abs=1e-12)
        assert optimizer.state[param]["exp_avg"].item() == pytest.approx(expected_momentum, abs=1e-12)
    assert set(optimizer.state[param]) == {"exp_avg"}


@pytest.mark.parametrize(
    "betas, message",
    [((1.0, 0.98), r"lion_beta1 must be in \[0, 1\), got 1.0"), ((0.9, -0.1), r"lion_beta2 must be in \[0, 1\)")],
)
def test_betas_outside_0_1_are_refused(betas, message):
    with pytest.raises(ValueError, match=message):
        Lion([torch.nn.Parameter(torch.zeros(1))], betas=betas)


def _lion_config(distributed: bool) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="lion",
        lr=1e-3,
        weight_decay=0.1,
        lion_beta1=0.9,
        lion_beta2=0.99,
        clip_grad=0.5,
        use_distributed_optimizer=distributed,
    )


def _data_parallel_lion_matches_one_process():
    Utils.initialize_model_parallel()
    reference = TinyLM()
    reference_norms = train_reference(reference, _lion_config(False), 3, 8, 2)
    results = {}
    for distributed in (False, True):
        model = wrap(TinyLM(), DistributedDataParallelConfig(use_distributed_optimizer=distributed))
        optimizer = get_megatron_optimizer(_lion_config(distributed), [model])
        norms = train_data_parallel(model, optimizer, 3, 8, 2)
        inner = optimizer.optimizer
        results[distributed] = (
            max_relative_error(weights(model.module), weights(reference)),
            max(abs(a - b) / b for a, b in zip(norms, reference_norms)),
            type(inner).__name__,
            sorted({key for state in inner.state.values() for key in state}),
            getattr(optimizer, "optimizer_state_keys", None),
        )
    return results


def test_lion_at_dp2_matches_one_process_under_ddp_and_the_distributed_optimizer():
    for results in run_distributed(2, _data_parallel_lion_matches_one_process):
        for distributed, (weight_error, norm_error, inner, state_keys, declared) in results.items():
            assert weight_error < 1e-5 and norm_error < 1e-5, f"distributed={distributed}"
            assert inner == "Lion" and state_keys == ["exp_avg"]
        assert results[True][4] == ("exp_avg",)


@pytest.mark.parametrize("sharding_type", ["dp_reshardable", "fully_reshardable"])
def test_lion_state_checkpoints_and_resumes_exactly(tmp_path, sharding_type):
    (tmp_path / "ckpt").mkdir()
    for result in run_distributed(2, save_then_resume, str(tmp_path / "ckpt"), sharding_type, {"optimizer": "lion"}):
        assert result["resumed"] == result["continued"]
        assert result["saved_dtypes"] == result["loaded_dtypes"] == ["torch.float32"]


def _muon_with_lion_scalars():
    Utils.initialize_model_parallel()
    model = wrap(TinyLM(), DistributedDataParallelConfig())
    config = OptimizerConfig(optimizer="muon", muon_scalar_optimizer="lion", lr=1e-3, lion_beta1=0.8)
    optimizer = get_megatron_optimizer(config, [model])
    train_data_parallel(model, optimizer, 1, 4, 1)
    parts = [part.optimizer for part in optimizer.chained_optimizers]
    return sorted((type(part).__name__, part.param_groups[0].get("betas")) for part in parts)


def test_lion_is_muons_scalar_optimizer():
    (parts,) = run_distributed(1, _muon_with_lion_scalars)
    assert parts[0] == ("Lion", (0.8, 0.98)) and parts[1][0] == "TensorParallelMuon"


def test_flags_reach_the_optimizer_config():
    config = get_megatron_optimizer_config(validated("--optimizer", "lion", "--lion-beta1", "0.5"))
    assert (config.optimizer, config.lion_beta1, config.lion_beta2) == ("lion", 0.5, 0.98)  # Megatron's beta2


def test_cpu_offload_with_lion_is_refused_naming_the_flags():
    with pytest.raises(ValueError) as raised:
        get_megatron_optimizer_config(validated("--optimizer", "lion", "--optimizer-cpu-offload"))
    assert (
        "--optimizer-cpu-offload runs Adam or SGD on each side of the offload, not --optimizer lion; use --optimizer "
        "adam or --optimizer sgd"
    ) in str(raised.value)
