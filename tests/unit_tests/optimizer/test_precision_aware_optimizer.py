"""The precision-aware optimizer (use_precision_aware_optimizer with main_params/main_grads/exp_avg/exp_avg_sq
dtypes): fp32 storage reproduces the plain distributed optimizer bit for bit at DP=1 and DP=2, lower storage stays
within its dtype's rounding, the state is held (and checkpointed) in the stored dtypes, and resuming from a
checkpoint continues the run exactly. Every configuration error names the field and the fix."""

from pathlib import Path

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdam
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils, run_distributed

VOCAB, SEQ, LR = 64, 8, 1e-2
BF16_MOMENTS = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


def _build(optimizer_kwargs: dict, grad_reduce_in_fp32: bool = True):
    Utils.initialize_model_parallel()
    torch.manual_seed(0)
    config = TransformerConfig(
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
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=grad_reduce_in_fp32)
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    optimizer_config = OptimizerConfig(lr=LR, bf16=True, use_distributed_optimizer=True, **optimizer_kwargs)
    return gpt, model, get_megatron_optimizer(optimizer_config, [model])


def _step(model, optimizer, seed: int) -> float:
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(100 * seed + rank)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]
    return loss.item()


def _train(optimizer_kwargs: dict, steps: int = 3, grad_reduce_in_fp32: bool = True):
    gpt, model, optimizer = _build(optimizer_kwargs, grad_reduce_in_fp32)
    initial = {name: p.detach().float().clone() for name, p in gpt.named_parameters()}
    losses = [_step(model, optimizer, seed) for seed in range(steps)]
    params = {name: p.detach().float().clone() for name, p in gpt.named_parameters()}
    state = next(iter(optimizer.optimizer.state.values()))
    main_param = next(iter(optimizer.optimizer.state))
    dtypes = {"main_param": main_param.dtype, **{k: state[k].dtype for k in ("exp_avg", "exp_avg_sq")}}
    return {
        "losses": losses,
        "initial": initial,
        "params": params,
        "dtypes": dtypes,
        "state_bytes": optimizer.state_bytes(),
    }


def _assert_close_in_lower_precision(plain: dict, aware: dict) -> None:
    """The training moved the weights by ``update``; storing optimizer state in 16 bits changes that move by a
    few bf16 roundings (2^-8 relative each), so the difference stays a few percent of it (an elementwise bound
    would not hold: Adam's update of a weight whose gradient is near zero flips with any rounding)."""
    names = list(plain["params"])
    update = torch.cat([(plain["params"][n] - plain["initial"][n]).flatten() for n in names])
    difference = torch.cat([(aware["params"][n] - plain["params"][n]).flatten() for n in names])
    assert difference.norm() < 2**-5 * update.norm(), (difference.norm(), update.norm())
    for mine, theirs in zip(aware["losses"], plain["losses"]):
        assert abs(mine - theirs) <= 1e-3 * abs(theirs)


def _plain_and_precision_aware(precision_aware_kwargs: dict, grad_reduce_in_fp32: bool = True, clip_grad=1.0):
    plain = _train({"clip_grad": clip_grad}, grad_reduce_in_fp32=grad_reduce_in_fp32)
    kwargs = dict(use_precision_aware_optimizer=True, clip_grad=clip_grad, **precision_aware_kwargs)
    return plain, _train(kwargs, grad_reduce_in_fp32=grad_reduce_in_fp32)


@pytest.mark.parametrize("world_size", [1, 2])
def test_fp32_storage_steps_exactly_as_the_plain_distributed_optimizer(world_size):
    for plain, aware in run_distributed(world_size, _plain_and_precision_aware, {}):
        assert aware["losses"] == plain["losses"]
        for name, value in plain["params"].items():
            assert torch.equal(aware["params"][name], value), name
        assert aware["dtypes"] == {"main_param": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}


def test_bf16_main_grads_read_the_bf16_buffer_and_match_the_plain_optimizer():
    # The plain optimizer widens a bf16 gradient into an fp32 copy; widening it inside the step gives the same bits.
    # (Clipping is off: it scales the bf16 gradient in place, which rounds, where the plain optimizer scales fp32.)
    bf16_grads = {"main_grads_dtype": torch.bfloat16}
    for plain, aware in run_distributed(2, _plain_and_precision_aware, bf16_grads, False, 0.0):
        for name, value in plain["params"].items():
            assert torch.equal(aware["params"][name], value), name


def test_bf16_moments_stay_within_bf16_rounding_and_halve_their_bytes():
    for plain, aware in run_distributed(2, _plain_and_precision_aware, BF16_MOMENTS):
        assert aware["dtypes"] == {"main_param": torch.float32, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
        _assert_close_in_lower_precision(plain, aware)
        # Adam's moments went from 4 + 4 to 2 + 2 bytes per element; the fp32 main params stayed at 4.
        assert aware["state_bytes"] * 12 == plain["state_bytes"] * 8


def test_fp16_main_params_are_stored_in_fp16():
    for plain, aware in run_distributed(1, _plain_and_precision_aware, {"main_params_dtype": torch.float16}):
        assert aware["dtypes"]["main_param"] == torch.float16
        _assert_close_in_lower_precision(plain, aware)


def save_then_resume(checkpoint: str, sharding_type: str, kwargs: dict):
    """Train 2 steps, save, take 2 more; then a fresh model and optimizer load the checkpoint and take those 2 steps
    again. Returns both runs' losses after the checkpoint and the dtypes of the saved and loaded optimizer tensors."""
    gpt, model, optimizer = _build(kwargs)
    for seed in range(2):
        _step(model, optimizer, seed)
    metadata = {"distrib_optim_sharding_type": sharding_type}
    model_state = gpt.sharded_state_dict(metadata=metadata)
    optimizer_state = optimizer.sharded_state_dict({"model": model_state}, metadata=metadata)
    saved_dtypes = sorted({str(t.dtype) for t in _tensors(optimizer_state["param_state"]) if t.dim()})
    dist_checkpointing.save({"model": model_state, "optimizer": optimizer_state}, checkpoint, content_metadata=metadata)
    # The second loss after the checkpoint is the first to depend on the optimizer state it restored.
    continued = [_step(model, optimizer, seed) for seed in (2, 3)]

    gpt, model, optimizer = _build(kwargs)
    model_state = gpt.sharded_state_dict(metadata=metadata)
    request = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict({"model": model_state}, is_loading=True, metadata=metadata),
    }
    loaded = dist_checkpointing.load(request, checkpoint)
    loaded_dtypes = sorted({str(t.dtype) for t in _tensors(loaded["optimizer"]["param_state"]) if t.dim()})
    gpt.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    state = next(iter(optimizer.optimizer.state.values()))
    return {
        "continued": continued,
        "resumed": [_step(model, optimizer, seed) for seed in (2, 3)],
        "saved_dtypes": saved_dtypes,
        "loaded_dtypes": loaded_dtypes,
        "state_dtype": state["exp_avg"].dtype,
    }


def _tensors(tree):
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors(value)]
    if isinstance(tree, (list, tuple)):
        return [t for value in tree for t in _tensors(value)]
    data = getattr(tree, "data", tree)
    return [data] if isinstance(data, torch.Tensor) else []


@pytest.mark.parametrize("sharding_type", ["fully_sharded_model_space", "dp_reshardable", "fully_reshardable"])
def test_checkpoint_keeps_the_stored_dtypes_and_resumes_exactly(tmp_path: Path, sharding_type):
    (tmp_path / "ckpt").mkdir()
    kwargs = dict(use_precision_aware_optimizer=True, **BF16_MOMENTS)
    for result in run_distributed(2, save_then_resume, str(tmp_path / "ckpt"), sharding_type, kwargs):
        assert result["resumed"] == result["continued"]
        # The fp32 main params and the bf16 moments, as the optimizer holds them.
        assert result["saved_dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert result["loaded_dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert result["state_dtype"] == torch.bfloat16


def test_precision_aware_adam_with_fp32_state_is_torch_adamw_bit_for_bit():
    torch.manual_seed(0)
    reference = torch.nn.Parameter(torch.randn(64))
    mine = torch.nn.Parameter(reference.detach().clone())
    torch_adamw = torch.optim.AdamW([reference], lr=LR, fused=True)
    aware = PrecisionAwareAdam([mine], lr=LR, fused=True, weight_decay=0.01, decoupled_weight_decay=True)
    for _ in range(4):
        grad = torch.randn(64)
        reference.grad, mine.grad = grad.clone(), grad.clone()
        torch_adamw.step()
        aware.step()
    assert torch.equal(reference, mine)


def test_precision_aware_adam_load_state_dict_keeps_the_moment_dtypes():
    param = torch.nn.Parameter(torch.randn(8))
    aware = PrecisionAwareAdam([param], lr=LR, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16)
    param.grad = torch.randn(8)
    aware.step()
    saved = aware.state_dict()
    aware.load_state_dict(saved)
    assert aware.state[param]["exp_avg"].dtype == torch.bfloat16
    assert aware.state[param]["exp_avg_sq"].dtype == torch.float16
    assert torch.equal(aware.state[param]["exp_avg"], saved["state"][0]["exp_avg"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(exp_avg_dtype=torch.bfloat16), "exp_avg_dtype=torch.bfloat16 needs use_precision_aware_optimizer=True"),
        (dict(use_precision_aware_optimizer=True), "needs use_distributed_optimizer=True"),
        (
            dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, optimizer="sgd"),
            "needs optimizer='adam', got 'sgd'",
        ),
        (
            dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, main_grads_dtype=torch.float16),
            "OptimizerConfig.main_grads_dtype=torch.float16 is not one of",
        ),
        (
            dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, main_params_dtype=torch.float16),
            "main_params_dtype=torch.float16 needs a bf16 or fp16 model",
        ),
        (
            dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, exp_avg_dtype=torch.uint8),
            "exp_avg_dtype=fp8 (torch.uint8) needs an fp8 scaling recipe (fp8_recipe)",
        ),
        (
            dict(
                use_precision_aware_optimizer=True,
                use_distributed_optimizer=True,
                exp_avg_sq_dtype=torch.uint8,
                fp8_recipe="tensorwise",
            ),
            "not supported yet: fp8 Adam moments",
        ),
    ],
)
def test_bad_precision_aware_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as error:
        OptimizerConfig(lr=LR, **kwargs)
    assert message in str(error.value)
