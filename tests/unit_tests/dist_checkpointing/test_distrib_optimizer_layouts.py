"""The distributed optimizer's checkpoint layouts against checkpoints written by Megatron-Core 0.19 itself.

The fixtures (``data/megatron_core_0_19_distopt``, made by ``tools/checkpoint/make_megatron_optimizer_fixtures.py``)
hold a tiny bf16 GPT and its DistributedOptimizer after one Adam step, in each of Megatron's sharding types, and the
losses Megatron computed next. Loading one here must restore the fp32 main parameters and Adam's moments exactly
(compared element by element with the fully_reshardable fixture of the same run, which stores them in model space)
and reproduce Megatron's loss after one more step.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils, run_distributed

FIXTURES = Path(__file__).parent / "data" / "megatron_core_0_19_distopt"


def _expected(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def build(tp: int, bucket_size, seed: int = 0):
    """Our model and optimizer, configured as the fixture script configures Megatron's."""
    Utils.initialize_model_parallel(tp)
    model_args = _expected("fully_reshardable_tp1_dp2")["model"]
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=model_args["num_layers"],
        hidden_size=model_args["hidden_size"],
        num_attention_heads=model_args["num_attention_heads"],
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    gpt = GPTModel(config, get_gpt_layer_local_spec(), model_args["vocab_size"], model_args["seq_length"])
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size,
    )
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=0.01, bf16=True, use_distributed_optimizer=True), [model]
    )
    return gpt, model, optimizer, model_args


def batch_loss(model, model_args, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    seq = model_args["seq_length"]
    tokens = torch.randint(0, model_args["vocab_size"], (2, seq + 1), generator=generator)
    positions = torch.arange(seq).unsqueeze(0).expand(2, seq)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    return model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).float().mean()


def train_step(model, optimizer, model_args, seed: int) -> float:
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = batch_loss(model, model_args, seed)
    loss.backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]
    return loss.item()


def load(gpt, optimizer, checkpoint: Path):
    metadata = dist_checkpointing.load_content_metadata(checkpoint)
    model_state = gpt.sharded_state_dict(metadata=metadata)
    request = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict({"model": model_state}, is_loading=True, metadata=metadata),
    }
    loaded = dist_checkpointing.load(request, checkpoint)
    gpt.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])  # the fp32 main params come from here, not from the bf16 weights
    return metadata


def model_space_state(gpt, optimizer) -> dict:
    """``{'optimizer.state.<name>.<key>': whole tensor}`` of this rank's TP slice, gathered over DP."""
    model_state = gpt.sharded_state_dict()
    state = optimizer.sharded_state_dict(
        {"model": model_state}, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
    )
    return {
        sharded.key: sharded.data.clone()
        for per_param in state["param_state"].values()
        for sharded in per_param.values()
    }


def _load_fixture_and_step(name: str, tp: int, bucket_size):
    gpt, model, optimizer, model_args = build(tp, bucket_size)
    metadata = load(gpt, optimizer, FIXTURES / name)
    mine = model_space_state(gpt, optimizer)
    step = optimizer.optimizer.state_dict()["state"][0]["step"].item()
    train_step(model, optimizer, model_args, seed=2)
    with torch.no_grad():
        loss = batch_loss(model, model_args, seed=3).item()
    return {"layout": metadata["distrib_optim_sharding_type"], "state": mine, "step": step, "loss": loss}


def _reference_state(tp: int):
    """The fully_reshardable fixture of the same run read as plain model-space tensors (no bucket logic)."""
    gpt, _, optimizer, _ = build(tp, None)
    metadata = load(gpt, optimizer, FIXTURES / f"fully_reshardable_tp{tp}_dp2")
    assert metadata["distrib_optim_sharding_type"] == "fully_reshardable"
    return model_space_state(gpt, optimizer)


def _compare_with_reference(name: str, tp: int, bucket_size):
    loaded = _load_fixture_and_step(name, tp, bucket_size)
    dist.barrier()
    Utils.destroy_model_parallel()
    reference = _reference_state(tp)
    assert loaded["state"].keys() == reference.keys()
    worst = max((loaded["state"][key] - reference[key]).abs().max().item() for key in reference)
    return {"layout": loaded["layout"], "worst": worst, "step": loaded["step"], "loss": loaded["loss"]}


@pytest.mark.parametrize(
    "name, tp, bucket_size",
    [
        ("dp_reshardable_tp1_dp2", 1, 500),
        ("dp_zero_gather_scatter_tp1_dp2", 1, 500),
        ("fully_reshardable_tp1_dp2", 1, None),
        ("dp_reshardable_tp2_dp2", 2, None),
    ],
)
def test_megatron_written_optimizer_state_loads_exactly(name, tp, bucket_size):
    results = run_distributed(2 * tp, _compare_with_reference, name, tp, bucket_size)
    expected = _expected(name)
    for result in results:
        assert result["layout"] == name.rsplit("_tp", 1)[0]
        # fp32 main params, exp_avg and exp_avg_sq, element for element. The reference run kept one bucket per buffer,
        # so its gradients were reduced in other chunks: it differs from the bucketed run in the last fp32 bits.
        assert result["worst"] <= (0.0 if bucket_size is None else 1e-8)
        assert result["step"] == 1
        assert result["loss"] == pytest.approx(expected["loss_after_step_2"], abs=2e-3)


def _layouts():
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _, model, optimizer, _ = build(1, 500)
    prefix = "optimizer.distributed.dp_group_idx_0."
    request = {
        name: ShardedObject(prefix + name, None, (1,), (0,))
        for name in ("per_bucket_numel", "per_bucket_numel_unpadded")
    }
    megatron = dist_checkpointing.load(request, FIXTURES / "dp_reshardable_tp1_dp2", validate_access_integrity=False)
    params = [param for param in model.module.parameters()]
    layout = DistributedOptimizer.compute_full_param_layout(params, 500, 2, model.ddp_config)
    ((key, computed),) = layout.layouts.items()
    buffer = model.buffers[0]
    return {
        "ours": (optimizer.per_bucket_numel, optimizer.per_bucket_numel_unpadded),
        "megatron": (megatron["per_bucket_numel"], megatron["per_bucket_numel_unpadded"]),
        "precomputed_equals_ddp": computed.param_index_map == buffer.param_index_map
        and computed.bucket_indices == buffer.bucket_indices,
        "key": key,
    }


def test_bucket_layout_agrees_with_megatron():
    """Our DDP buckets, and compute_full_param_layout's, are the ones Megatron-Core 0.19 recorded in its checkpoint."""
    for result in run_distributed(2, _layouts):
        assert result["ours"] == result["megatron"]
        assert result["precomputed_equals_ddp"]
        assert result["key"] == (torch.bfloat16, torch.float32, False)
