"""Write the distributed-optimizer checkpoint fixtures with Megatron-Core itself (run offline, not by the tests).

The fixtures under ``tests/unit_tests/dist_checkpointing/data/megatron_core_0_19_distopt/`` prove that we read what
Megatron-Core 0.19 writes, tensor by tensor. Each ``<layout>_tp<T>_dp<D>/`` directory is one ``torch_dist``
checkpoint of a tiny bf16 GPT (local layer spec) with its DistributedOptimizer (Adam, fp32 main params, fp32 gradient
buffers, several buckets so shards straddle parameters), saved after one training step in one of Megatron's
sharding types. ``expected.json`` holds the batches and the losses Megatron computed: ``loss_after_step_2`` is the
loss of the fixed batch after a second step taken from the saved state, so a load that restores the Adam moments
exactly reproduces it.

``--verify DIR`` goes the other way: Megatron-Core loads every ``<layout>_tp<T>_dp<D>/`` checkpoint in DIR (written
by this project, with a ``.json`` beside it giving ``bucket_size`` and our ``loss_after_step_2``), takes the second
step and prints whether its loss matches ours.

How to regenerate (a CPU-only torch is enough; Megatron's hard-coded CUDA devices are mapped to the CPU here)::

    git clone https://github.com/NVIDIA/Megatron-LM /tmp/mlm && git -C /tmp/mlm checkout core_v0.19.0
    python -m venv --system-site-packages /tmp/mvenv && /tmp/mvenv/bin/pip install triton einops
    MEGATRON_PATH=/tmp/mlm /tmp/mvenv/bin/python tools/checkpoint/make_megatron_optimizer_fixtures.py \\
        tests/unit_tests/dist_checkpointing/data/megatron_core_0_19_distopt
"""

import contextlib
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Megatron's own package, ahead of this project's ``megatron`` (the spawned ranks import this module afresh).
sys.path.insert(0, os.environ.get("MEGATRON_PATH", "/tmp/mlm"))

# (tensor-parallel size, data-parallel size, bucket size, sharding types saved from the same trained state).
# Several buckets (Megatron buckets only with overlap_grad_reduce) put padding between buckets, which the bucket-space
# layouts must carry. fully_reshardable is written from one bucket per buffer (Megatron's default): Megatron-Core 0.19
# slices its gathered, padding-free buffer with padded buffer offsets, so with several buckets it stores the wrong
# elements for every parameter after the first bucket (see docs/compatibility.md).
RUNS = [
    (1, 2, 500, ("dp_reshardable", "dp_zero_gather_scatter")),
    (1, 2, None, ("fully_reshardable",)),
    (2, 2, None, ("dp_reshardable", "fully_reshardable")),
]
MODEL = dict(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=16, seq_length=8)
SEED, LR = 1234, 0.01


def _map_cuda_to_cpu() -> None:
    """Megatron allocates on ``'cuda'`` and checks ``tensor.type()`` for ``torch.cuda.*``: point both at the CPU."""

    def cpu(device):
        is_cuda = isinstance(device, int) or (device is not None and torch.device(device).type == "cuda")
        return "cpu" if is_cuda else device

    def with_cpu_device(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like"):
        setattr(torch, name, with_cpu_device(getattr(torch, name)))
    tensor_to, tensor_type = torch.Tensor.to, torch.Tensor.type

    def to(self, *args, **kwargs):
        args = tuple(cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        kwargs = {k: cpu(v) if k == "device" else v for k, v in kwargs.items()}
        return tensor_to(self, *args, **kwargs)

    def cuda_type(self, *args, **kwargs):
        name = tensor_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    torch.Tensor.to, torch.Tensor.type = to, cuda_type
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    # The model-parallel RNG tracker keeps CUDA generator states; dropout is off, so its forks need no state.
    from megatron.core.tensor_parallel import random

    random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    # Without Apex/TE, torch's Adam keeps a per-parameter 'step' tensor, which Megatron's model-space and dp_zero
    # loaders do not provide (the step comes from the param groups): keep the current one for them.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_keeping_step(self, model_param, tensors):
        current = self._get_main_param_and_optimizer_states(model_param)
        set_states(self, model_param, {"step": current.get("step"), **tensors})

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_keeping_step


class _NoStream:
    """CPU work is synchronous: nothing to wait for."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


def batch(step: int):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_length"] + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(model, step):
    tokens, labels = batch(step)
    seq = MODEL["seq_length"]
    positions = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    return model(tokens, positions, causal, labels=labels).float().mean()


def _train_step(model, optimizer, step):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = _loss(model, step)
    loss.backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]
    return loss.item()


def _build(tp, bucket_size):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(SEED)
    config = TransformerConfig(
        num_layers=MODEL["num_layers"],
        hidden_size=MODEL["hidden_size"],
        num_attention_heads=MODEL["num_attention_heads"],
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), MODEL["vocab_size"], MODEL["seq_length"])
    model = Float16Module(config, model)  # as megatron.training wraps a bf16 model
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size,
    )
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer_config = OptimizerConfig(optimizer="adam", lr=LR, bf16=True, use_distributed_optimizer=True)
    return model, get_megatron_optimizer(optimizer_config, [model])


def _save(model, optimizer, directory, sharding_type):
    from megatron.core import dist_checkpointing, parallel_state

    metadata = {"distrib_optim_sharding_type": sharding_type, "singleton_local_shards": False}
    metadata["chained_optim_avoid_prefix"] = True
    if sharding_type == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    content_metadata = dict(metadata)
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    gpt_model = model.module.module  # megatron.training saves the model without its DDP and Float16Module wrappers
    model_state = gpt_model.sharded_state_dict(metadata=metadata)
    state = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict({"model": model_state}, metadata=metadata),
        "iteration": 1,
        "checkpoint_version": 3.0,
    }
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(state, directory, content_metadata=content_metadata)


def _run(rank, world, tp, bucket_size, sharding_types, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _map_cuda_to_cpu()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model, optimizer = _build(tp, bucket_size)
    losses = {"loss_step_1": _train_step(model, optimizer, 1)}
    for sharding_type in sharding_types:
        _save(model, optimizer, os.path.join(out, f"{sharding_type}_tp{tp}_dp{world // tp}"), sharding_type)
    losses["loss_step_2"] = _train_step(model, optimizer, 2)
    with torch.no_grad():
        losses["loss_after_step_2"] = _loss(model, 3).item()
    if rank == 0:
        run = {"model": MODEL, "seed": SEED, "lr": LR, "bucket_size": bucket_size, "batch_seeds": [1, 2, 3], **losses}
        for sharding_type in sharding_types:
            with open(os.path.join(out, f"{sharding_type}_tp{tp}_dp{world // tp}.json"), "w") as file:
                json.dump(run, file, indent=1)
    dist.destroy_process_group()


def _verify(rank, world, tp, bucket_size, checkpoint, expected_loss, port):
    """Megatron-Core loads a checkpoint of ours, steps once more and compares the loss with ours."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _map_cuda_to_cpu()
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model, optimizer = _build(tp, bucket_size)
    # Megatron-Core's DistributedOptimizer.state_dict() without Apex/TE reads the step from the Adam state, which
    # exists only after a step: take one (the load below overwrites weights, moments and step).
    _train_step(model, optimizer, 1)
    metadata = dist_checkpointing.load_content_metadata(checkpoint)
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    gpt_model = model.module.module
    model_state = gpt_model.sharded_state_dict(metadata=metadata)
    request = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict({"model": model_state}, is_loading=True, metadata=metadata),
    }
    loaded = dist_checkpointing.load(request, checkpoint)
    gpt_model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    # Megatron's parameter state, gathered over the data-parallel ranks, against ours at the moment we saved.
    mine = optimizer.chained_optimizers[0].get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
    theirs = torch.load(f"{checkpoint}.world.pt", weights_only=True)[parallel_state.get_tensor_model_parallel_rank()]
    worst = max(
        (mine[index][dtype][name] - theirs[index][dtype][name]).abs().max().item()
        for index in range(len(optimizer.chained_optimizers[0].buffers))
        for dtype in mine[index]
        for name in ("param", "exp_avg", "exp_avg_sq")
    )
    _train_step(model, optimizer, 2)
    with torch.no_grad():
        loss = _loss(model, 3).item()
    verdict = "OK" if worst == 0.0 else "MISMATCH"
    print(
        f"{verdict} {os.path.basename(checkpoint)} rank {rank}: largest difference of the loaded fp32 params, exp_avg "
        f"and exp_avg_sq {worst:.3g}; loss after one more step: Megatron {loss:.6f}, ours {expected_loss:.6f}",
        flush=True,
    )
    dist.destroy_process_group()


def verify(directory: str) -> None:
    names = sorted(name[: -len(".json")] for name in os.listdir(directory) if name.endswith(".json"))
    for port, name in enumerate(names, start=29581):
        with open(os.path.join(directory, f"{name}.json")) as file:
            expected = json.load(file)
        tp, dp = (int(part) for part in name.rsplit("_tp", 1)[1].split("_dp"))
        args = (tp * dp, tp, expected["bucket_size"], os.path.join(directory, name), expected["loss_after_step_2"])
        if not os.path.exists(os.path.join(directory, f"{name}.world.pt")):
            continue
        mp.spawn(_verify, args=(*args, port), nprocs=tp * dp)


if __name__ == "__main__":
    if sys.argv[1] == "--verify":
        verify(sys.argv[2])
        sys.exit(0)
    out_dir = sys.argv[1]
    for port, (tp, dp, bucket_size, types) in enumerate(RUNS, start=29561):
        mp.spawn(_run, args=(tp * dp, tp, bucket_size, types, out_dir, port), nprocs=tp * dp)
