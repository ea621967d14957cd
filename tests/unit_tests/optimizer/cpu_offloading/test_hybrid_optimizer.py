"""HybridDeviceOptimizer (--optimizer-cpu-offload): on a CPU-only machine the offload path runs with host memory on
both sides and must step exactly as the plain optimizer, at every offload fraction, alone, under the mixed-precision
wrapper and under the distributed optimizer at DP=1, DP=2, DP=4 and TP2 x DP2 (where the precision-aware
optimizer's fp32 storage is checked the same way); its state lives on the host side it was assigned to,
survives a state_dict round trip, and a fraction outside [0, 1] is refused naming the field."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.optimizer.test_precision_aware_optimizer import save_then_resume
from tests.unit_tests.test_utilities import Utils, run_distributed

VOCAB, SEQ = 64, 8


def _params(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (8, 8), (4, 8), (4,)]
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _run(optimizer_factory, steps: int = 4):
    params = _params()
    optimizer = optimizer_factory(params)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
        optimizer.zero_grad()
    return params, optimizer


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_every_fraction_steps_exactly_as_the_plain_optimizer(fraction, optimizer_class):
    kwargs = dict(lr=1e-2, weight_decay=0.1, fused=True)
    if optimizer_class is torch.optim.SGD:
        kwargs["momentum"] = 0.9
    reference, _ = _run(lambda params: optimizer_class(params, **kwargs))
    offloaded, hybrid = _run(
        lambda params: HybridDeviceOptimizer(
            params,
            offload_fraction=fraction,
            cpu_optimizer_cls=optimizer_class,
            gpu_optimizer_cls=optimizer_class,
            **kwargs,
        )
    )
    for mine, theirs in zip(offloaded, reference):
        assert torch.equal(mine, theirs)
    # Whole parameters (128, 8, 64, 32 and 4 elements), in order, each one that still fits in the fraction of 236.
    assert hybrid.offloaded_numel == {0.0: 0, 0.3: 8 + 32 + 4, 0.5: 8 + 64 + 32 + 4, 1.0: 236}[fraction]
    # Each parameter's state is the dict of the side that steps it, and the host side holds host copies.
    host_optimizer, device_optimizer = hybrid.sub_optimizers
    for param, host_param, _ in hybrid.offloaded:
        assert hybrid.state[param] is host_optimizer.state[host_param]
        assert host_param is not param and host_param.data_ptr() != param.data_ptr()


def test_state_dict_round_trip_keeps_each_state_on_its_side():
    params, hybrid = _run(lambda params: HybridDeviceOptimizer(params, offload_fraction=0.5, lr=1e-2, fused=True))
    saved = hybrid.state_dict()
    fresh = HybridDeviceOptimizer(params, offload_fraction=0.5, lr=1e-2, fused=True)
    fresh.init_state()
    fresh.load_state_dict(saved)
    for param, host_param, _ in fresh.offloaded:
        assert fresh.state[param] is fresh.sub_optimizers[0].state[host_param]
        assert torch.equal(fresh.state[param]["exp_avg"], hybrid.state[param]["exp_avg"])
    assert fresh.state_dict()["state"].keys() == saved["state"].keys()


def test_lr_changes_reach_both_sides():
    params = _params()
    hybrid = HybridDeviceOptimizer(params, offload_fraction=0.5, lr=1e-2)
    for param in params:
        param.grad = torch.ones_like(param)
    hybrid.step()
    for group in hybrid.param_groups:
        group["lr"] = 0.5
    hybrid.step()
    assert all(group["lr"] == 0.5 for sub in hybrid.sub_optimizers for group in sub.param_groups)


def test_offload_fraction_outside_0_1_is_refused():
    with pytest.raises(ValueError, match=r"offload_fraction=1.5 is outside \[0, 1\]"):
        HybridDeviceOptimizer(_params(), offload_fraction=1.5)
    with pytest.raises(ValueError, match=r"OptimizerConfig.optimizer_offload_fraction=-0.1 is outside \[0, 1\]"):
        OptimizerConfig(lr=1e-3, optimizer_cpu_offload=True, optimizer_offload_fraction=-0.1)


def _gpt_run(optimizer_kwargs: dict, distributed: bool, steps: int = 3, tp: int = 1):
    Utils.initialize_model_parallel(tp)
    torch.manual_seed(0)
    config = TransformerConfig(
        tensor_model_parallel_size=tp,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    gpt = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=distributed, **optimizer_kwargs), [model]
    )
    rank = parallel_state.get_data_parallel_rank()  # tensor-parallel ranks share a batch
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    losses = []
    for seed in range(steps):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(100 * seed + rank))
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        model.finish_grad_sync()
        assert optimizer.step()[0]
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    hybrid = optimizer.optimizer
    offloaded = hybrid.offloaded_numel if isinstance(hybrid, HybridDeviceOptimizer) else 0
    moment_dtypes = sorted({str(state["exp_avg"].dtype) for state in hybrid.state.values() if "exp_avg" in state})
    return losses, params, offloaded, moment_dtypes


def _plain_and_offloaded(distributed: bool, fraction: float, base: dict = None):
    plain = _gpt_run(dict(base or {}), distributed)
    offload = _gpt_run(dict(base or {}, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction), distributed)
    return plain, offload


@pytest.mark.parametrize("world_size, distributed", [(1, False), (1, True), (2, True)])
def test_offloaded_gpt_training_equals_the_plain_optimizer(world_size, distributed):
    for plain, offload in run_distributed(world_size, _plain_and_offloaded, distributed, 0.6):
        assert offload[0] == plain[0]
        for name, value in plain[1].items():
            assert torch.equal(offload[1][name], value), name
        assert offload[2] > 0


def test_offloaded_precision_aware_optimizer_equals_the_device_one():
    # bf16 moments and bf16 main grads (read from param.decoupled_grad, widened into the host buffer exactly).
    precision_aware = dict(
        use_precision_aware_optimizer=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        main_grads_dtype=torch.bfloat16,
    )
    for device_only, offload in run_distributed(2, _plain_and_offloaded, True, 0.6, precision_aware):
        assert offload[0] == device_only[0]
        for name, value in device_only[1].items():
            assert torch.equal(offload[1][name], value), name
        assert offload[2] > 0
        assert offload[3] == device_only[3] == ["torch.bfloat16"]


def _plain_offloaded_and_fp32_precision_aware():
    """At DP4, then TP2 x DP2: (plain distributed optimizer, offloaded, precision-aware with fp32 storage) runs."""
    runs = {}
    for layout, tp in (("DP4", 1), ("TP2 x DP2", 2)):
        plain = _gpt_run({}, True, tp=tp)
        offload = _gpt_run(dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.6), True, tp=tp)
        runs[layout] = plain, offload, _gpt_run(dict(use_precision_aware_optimizer=True), True, tp=tp)
    return runs


def test_offload_and_fp32_precision_aware_storage_equal_the_plain_optimizer_at_dp4_and_tp2_dp2():
    # One 4-rank run checks both layouts against the plain distributed optimizer, bit for bit (the same arithmetic,
    # only stored elsewhere), on each rank's tensor-parallel shards.
    for runs in run_distributed(4, _plain_offloaded_and_fp32_precision_aware):
        for layout, (plain, offload, aware) in runs.items():
            for name, run in (("offload", offload), ("precision-aware fp32", aware)):
                assert run[0] == plain[0], f"{layout} {name}"
                for param, value in plain[1].items():
                    assert torch.equal(run[1][param], value), f"{layout} {name}: {param}"
            assert offload[2] > 0 and aware[3] == plain[3] == ["torch.float32"], layout


@pytest.mark.parametrize("sharding_type", ["fully_sharded_model_space", "dp_reshardable"])
def test_offloaded_state_checkpoints_and_resumes_exactly(tmp_path, sharding_type):
    (tmp_path / "ckpt").mkdir()
    kwargs = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    for result in run_distributed(2, save_then_resume, str(tmp_path / "ckpt"), sharding_type, kwargs):
        assert result["resumed"] == result["continued"]
        assert result["saved_dtypes"] == result["loaded_dtypes"] == ["torch.float32"]


def test_a_parameter_written_between_steps_is_refreshed_on_the_host():
    # e.g. a checkpoint load or a wrapper reloading its main params: the host copy must not overwrite the new value.
    params = _params()
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    hybrid = HybridDeviceOptimizer(params, offload_fraction=1.0, lr=1e-2)
    plain = torch.optim.AdamW(plain_params, lr=1e-2)
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                for a, b in zip(params, plain_params):
                    a.fill_(0.5)
                    b.fill_(0.5)
        for a, b in zip(params, plain_params):
            a.grad = torch.full_like(a, 0.1 * (step + 1))
            b.grad = a.grad.clone()
        hybrid.step()
        plain.step()
    for a, b in zip(params, plain_params):
        assert torch.equal(a, b)
