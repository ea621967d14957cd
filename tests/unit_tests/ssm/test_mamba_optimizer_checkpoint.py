"""A Mamba layer trained with the distributed optimizer (whose flat shards cut through in_proj / conv1d, so the
split factory stores slices of their segments) saves at TP=2 x DP=2 and resumes at TP=1 with the plain optimizer:
the next Adam step -- which depends on the loaded moments and step count, not only the weights -- gives the weights
that continuing without a save gives."""

import torch

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.ssm import mamba_test_helpers as helpers
from tests.unit_tests.test_utilities import run_distributed

PREFIX = "decoder.layers.0."


def _build(tp, seed, distributed_optimizer):
    layer = helpers.build_layer(tp, seed=seed, chunk_size=5)
    # Small buckets: the distributed optimizer's shards then start and end inside in_proj's and conv1d's segments.
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, bucket_size=300 if distributed_optimizer else None
    )
    model = DistributedDataParallel(layer.config, ddp_config, layer)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, weight_decay=0.1, use_distributed_optimizer=distributed_optimizer), [model]
    )
    return model, optimizer


def _step(model, optimizer, step):
    """One Adam step on the same global batch at any layout (each data-parallel rank takes its share of it)."""
    generator = torch.Generator().manual_seed(100 + step)
    batch = torch.randn(helpers.SEQ, 4, helpers.HIDDEN, generator=generator)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    local = batch[:, dp_rank * 4 // dp_size : (dp_rank + 1) * 4 // dp_size]
    model.zero_grad_buffer()
    optimizer.zero_grad()
    # Mean over the global batch: DDP averages over data-parallel ranks.
    model(local).square().mean().backward()
    finalize_model_grads([model])
    assert optimizer.step()[0]
    model.state_dict()  # completes a pending parameter all-gather


def _checkpoint(model, optimizer, is_loading=False):
    state = {"model": model.module.sharded_state_dict(prefix=PREFIX)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading)
    return state


def _whole(model):
    layer = model.module
    weights = {"norm.weight": layer.norm.weight.detach().clone()}
    weights.update(helpers.whole_parameters(layer.mixer))
    return weights


def _train_save_continue(directory):
    model, optimizer = _build(2, seed=1, distributed_optimizer=True)
    _step(model, optimizer, 0)
    dist_checkpointing.save(_checkpoint(model, optimizer), directory)
    _step(model, optimizer, 1)
    return _whole(model)


def _load_and_step(directory):
    model, optimizer = _build(1, seed=5, distributed_optimizer=False)
    loaded = dist_checkpointing.load(_checkpoint(model, optimizer, is_loading=True), directory)
    model.module.load_state_dict({key[len(PREFIX) :]: value for key, value in loaded["model"].items()})
    optimizer.load_state_dict(loaded["optimizer"])
    loaded_weights = _whole(model)
    _step(model, optimizer, 1)
    return loaded_weights, _whole(model)


def test_distributed_optimizer_checkpoint_of_a_mamba_layer_resumes_at_another_layout(tmp_path):
    continued = run_distributed(4, _train_save_continue, tmp_path)[0]
    loaded, resumed = run_distributed(1, _load_and_step, tmp_path)[0]
    for name, value in continued.items():
        assert not torch.equal(loaded[name], value), f"{name}: the step after the save changed nothing"
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
