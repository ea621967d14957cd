"""Bytes a rank holds between steps, summed from the real tensors, and what the sharding strategy predicts.

``held_bytes`` walks the wrapped model chunks (parameters, gradient buffers and FSDP shards) and the optimizer
(main parameters and state) and counts each storage once, at its current size, so a freed buffer counts zero and
a view of a counted storage (an fp32 main parameter that is the model's own shard) adds nothing.
``expected_held_bytes`` is the formula of each layout, from the buffers' padded sizes.

:class:`PeakLiveBytes` measures the peak during a step, where CPU tensors have no allocator statistics: the bytes of
the storages alive after each operation, at their current size (see its docstring).
"""

import weakref
from typing import Dict, Iterable, Iterator, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.distributed.fsdp.sharded_buffer import ShardedParamAndGradBuffer


class _StorageCounter:
    def __init__(self):
        self.seen = set()

    def add(self, tensor: torch.Tensor) -> int:
        """The bytes of ``tensor``'s storage the first time it is seen, else 0."""
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0 or key in self.seen:
            return 0
        self.seen.add(key)
        return storage.nbytes()


def _buffers(chunk) -> list:
    return list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))


def _torch_optimizers(optimizer) -> Iterable[torch.optim.Optimizer]:
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(member, "optimizer", None)
        if inner is not None:
            yield inner


def held_bytes(model_chunks: List[torch.nn.Module], optimizer) -> Dict[str, int]:
    """``{"params", "grads", "optimizer", "total"}``: bytes this rank holds now (call it between steps)."""
    counter = _StorageCounter()
    params = grads = state = 0
    for chunk in model_chunks:
        for buffer in _buffers(chunk):
            if isinstance(buffer, ShardedParamAndGradBuffer) and buffer.param_shard is not None:
                params += counter.add(buffer.param_shard)
        for param in chunk.parameters():
            params += counter.add(param.data)
        for buffer in _buffers(chunk):
            grads += counter.add(buffer.grad_data)
            if isinstance(buffer, ShardedParamAndGradBuffer):
                grads += counter.add(buffer.grad_shard)
    for inner in _torch_optimizers(optimizer):
        for group in inner.param_groups:
            for main_param in group["params"]:
                state += counter.add(main_param)
                if main_param.grad is not None:
                    grads += counter.add(main_param.grad)
        for values in inner.state.values():
            for value in values.values():
                # The step counter is a 0-d tensor per parameter: bookkeeping, not optimizer state.
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state += counter.add(value)
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


def expected_held_bytes(model_chunk, state_bytes_per_element: int) -> Dict[str, float]:
    """The formula for one wrapped chunk: ``{"params", "grads", "optimizer"}`` in bytes on every rank.

    With N the padded elements of a buffer, P the parameter elements, d the data-parallel size and p / g the
    parameter / gradient element sizes: parameters are P·p (DDP), N·p (a parameter buffer) or N·p/d (sharded);
    gradients N·g, or N·g/d when sharded; optimizer state ``state_bytes_per_element`` (8 for Adam's moments,
    + 4 for an fp32 main copy of bf16 / fp16 parameters) per element, P·s unsharded or on average P·s/d.
    """
    strategy = getattr(model_chunk, "data_parallel_sharding_strategy", None)
    distributed = model_chunk.ddp_config.use_distributed_optimizer
    params = grads = optimizer = 0.0
    for buffer in _buffers(model_chunk):
        d = buffer.data_parallel_world_size
        p_size = torch.tensor([], dtype=buffer.param_dtype).element_size()
        g_size = torch.tensor([], dtype=buffer.grad_dtype).element_size()
        elements = sum(param.numel() for param in buffer.params)
        if not distributed:
            params += elements * p_size
        elif strategy == "optim_grads_params":
            params += buffer.numel * p_size / d
        else:
            params += buffer.numel * p_size
        sharded_grads = strategy in ("optim_grads", "optim_grads_params")
        grads += buffer.numel * g_size / (d if sharded_grads else 1)
        optimizer += elements * state_bytes_per_element / (d if distributed else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer}


def held_tensors(model_chunks: List[torch.nn.Module], optimizer) -> Iterator[torch.Tensor]:
    """Every tensor :func:`held_bytes` counts (one or more per storage)."""
    for chunk in model_chunks:
        for buffer in _buffers(chunk):
            # A DDP buffer without the distributed optimizer has no parameter buffer (param_data None).
            yield from (tensor for tensor in (buffer.param_data, buffer.grad_data) if tensor is not None)
            if isinstance(buffer, ShardedParamAndGradBuffer):
                yield buffer.grad_shard
                if buffer.param_shard is not None:
                    yield buffer.param_shard
        yield from (param.data for param in chunk.parameters())
    for inner in _torch_optimizers(optimizer):
        for group in inner.param_groups:
            yield from group["params"]
            yield from (param.grad for param in group["params"] if param.grad is not None)
        for values in inner.state.values():
            yield from (value for value in values.values() if isinstance(value, torch.Tensor))


class PeakLiveBytes(TorchDispatchMode):
    """Inside ``with PeakLiveBytes(held) as peak:``, ``peak.peak_bytes`` is the largest number of bytes of tensor
    storage alive after any operation: the storages of ``held`` (what exists before the region, e.g.
    :func:`held_tensors`), each once at its current size, since FSDP grows and frees its buffers in place, plus every
    storage an operation in the region creates, from its creation until the last tensor on it is freed (a weakref
    finalizer per tensor). Tensors made before the region and not in ``held`` (the input batch) are not counted;
    neither are an operation's temporaries that never leave it (inside one kernel)."""

    def __init__(self, held: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._held = {}
        for tensor in held:
            self._held.setdefault(tensor.untyped_storage()._cdata, tensor)
        self._live = {}  # storage -> [bytes, tensors alive on it]
        self._live_bytes = 0
        self.peak_bytes = self._current()

    def _current(self) -> int:
        held = sum(tensor.untyped_storage().nbytes() for tensor in self._held.values())
        return held + self._live_bytes

    def _track(self, tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage()._cdata
        if key in self._held:
            return
        if key not in self._live:
            self._live[key] = [tensor.untyped_storage().nbytes(), 0]
            self._live_bytes += self._live[key][0]
        self._live[key][1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self._live_bytes -= entry[0]
            del self._live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self._track(tensor)
        self.peak_bytes = max(self.peak_bytes, self._current())
        return out
