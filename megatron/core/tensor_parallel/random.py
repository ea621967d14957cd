"""Random-number streams for model parallelism, and activation recomputation that replays them.

Megatron keeps several generator states and swaps them into the device generator on demand:

- the default generator (seeded with ``seed``) is shared by a tensor-parallel group: dropout in regions where every
  TP rank holds the same activations must draw the same mask;
- ``model-parallel-rng`` (``seed + 2718 + tp_rank``) differs per TP rank: weights initialised shard by shard and
  dropout on tensor-parallel (or sequence-parallel) activations must draw independent values;
- ``expert-parallel-rng`` (``seed + 1024 + 100 * ep_rank + expert_tp_rank``) does the same for MoE experts;
- ``data-parallel-rng`` holds ``seed`` itself, for code that wants to name the shared stream.

"Device generator" means the CUDA generator of the current device when CUDA is available and the CPU generator
otherwise, so the names that say "cuda" (kept for Megatron compatibility) work on CPU too.

Activation recomputation comes in two forms: :func:`checkpoint` (recompute a block's activations in backward) and
:class:`CheckpointWithoutOutput` (also free the block's *output*, recomputing it just before the next op's backward
needs it).
"""

from __future__ import annotations

import contextlib
import random as python_random
from typing import Any, Callable, Dict, List, Optional, TypeVar, TypeVarTuple, Union, Unpack

import numpy as np
import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import (
    gather_split_1d_tensor,
    group_size,
    resolve_tp_group,
    split_tensor_into_1d_equal_chunks,
)
from megatron.core.utils import get_current_device, warn_once

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"

_Ts = TypeVarTuple("_Ts")
_R = TypeVar("_R")

# True while a checkpointed function runs (its first forward and its recomputation), see is_checkpointing().
_CHECKPOINTING_DEPTH = 0

# Megatron's seed offsets: fixed so that runs are reproducible across implementations.
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def is_checkpointing():
    """True while activation recomputation runs a checkpointed function (its first forward or its recomputation),
    so code inside can tell it is being checkpointed."""
    return _CHECKPOINTING_DEPTH > 0


@contextlib.contextmanager
def _checkpointing():
    global _CHECKPOINTING_DEPTH
    _CHECKPOINTING_DEPTH += 1
    try:
        yield
    finally:
        _CHECKPOINTING_DEPTH -= 1


def convert_cuda_rng_state(
    state: Union[torch.Tensor, torch.Generator], to_graphable: bool = False
) -> Union[torch.Tensor, torch.Generator]:
    """Convert a generator state between its two forms: a state tensor, and (``to_graphable``) a
    ``torch.Generator`` holding it on the current device, the form CUDA-graph-safe trackers keep."""
    if to_graphable:
        if isinstance(state, torch.Generator):
            return state
        generator = torch.Generator(device=get_current_device())
        generator.set_state(state)
        return generator
    return state.get_state() if isinstance(state, torch.Generator) else state


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker):
    """Whether the tracker keeps CUDA-graph-safe generator states (never true for this package's trackers)."""
    return bool(getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


def get_all_rng_states():
    """Every random state a resumed run needs: Python's, NumPy's, torch's CPU and device generators, the tracker's."""
    states = {
        "random_rng_state": python_random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    if get_current_device().type != "cpu":
        states["cuda_rng_state"] = get_device_rng_state()
    return states


# ---- the device generator ------------------------------------------------------------------------------------------


def get_device_rng_state() -> torch.Tensor:
    """State of the generator that dropout on this rank's compute device draws from."""
    device = get_current_device()
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device).get_rng_state(device)


def set_device_rng_state(state: torch.Tensor) -> None:
    """Restore a state returned by :func:`get_device_rng_state`."""
    device = get_current_device()
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device).set_rng_state(state, device)


def _device_rng_state_for_seed(seed: int) -> torch.Tensor:
    # A private generator computes the state without disturbing the live one.
    return torch.Generator(device=get_current_device()).manual_seed(seed).get_state()


# ---- the tracker ---------------------------------------------------------------------------------------------------


class CudaRNGStatesTracker:
    """Named generator states that :meth:`fork` swaps into the device generator.

    Inside ``with tracker.fork(name):`` random ops draw from stream ``name``; on exit the stream's advanced state is
    stored and the generator is put back as it was, so the default stream is untouched by what ran inside.
    Forks of different streams nest; do not nest two forks of the same stream (the inner one would restart it from
    its stored state, repeating values the outer one already drew).
    """

    def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
        if use_cudagraphable_rng:
            raise ValueError(
                "not supported yet: CUDA-graph-safe RNG states (use_cudagraphable_rng=True); leave it False"
            )
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        """Forget every stream."""
        self._is_initialized = False
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the streams' states (name -> generator state), for checkpoints and recomputation."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace every stream's state (the dict is copied, so later forks do not change the caller's)."""
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` from ``seed``; both must be new to this tracker."""
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already used by another stream; give stream {name!r} its own seed")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists; call reset() first to re-create it")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = _device_rng_state_for_seed(seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Draw from stream ``name`` inside the ``with`` block."""
        if name not in self.states_:
            raise KeyError(
                f"RNG stream {name!r} was never added (known: {sorted(self.states_)}); "
                "call model_parallel_cuda_manual_seed(seed) after initialize_model_parallel()"
            )
        outside_state = get_device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state()
            set_device_rng_state(outside_state)


class InferenceCudaRNGStatesTracker(CudaRNGStatesTracker):
    """Tracker for inference: dropout is off, so streams are not kept and ``fork`` changes nothing."""

    def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=True):
        super().__init__(use_cudagraphable_rng, is_inference_rng_tracker=True)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        yield


_CUDA_RNG_STATE_TRACKER: Optional[CudaRNGStatesTracker] = None


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
):
    """Create the global tracker (again when ``force_reset`` or when a different kind is asked for).

    Transformer Engine's tracker and CUDA-graph-safe generator states are GPU accelerators that are not available
    here; asking for them warns once and uses the plain tracker, which draws the same streams.
    """
    global _CUDA_RNG_STATE_TRACKER
    if use_te_rng_tracker:
        warn_once("use_te_rng_tracker=True needs Transformer Engine; using megatron-lite's CudaRNGStatesTracker")
    if use_cudagraphable_rng:
        warn_once(
            "use_cudagraphable_rng=True is a CUDA-graph feature that is not available; using the plain "
            "(not graph-safe) tracker"
        )
    kind = InferenceCudaRNGStatesTracker if inference_rng_tracker else CudaRNGStatesTracker
    if force_reset or type(_CUDA_RNG_STATE_TRACKER) is not kind:
        _CUDA_RNG_STATE_TRACKER = kind()


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
):
    """The global tracker (created on first use)."""
    if _CUDA_RNG_STATE_TRACKER is None:
        initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: Optional[int] = None,
    ep_rank: Optional[int] = None,
    etp_rank: Optional[int] = None,
    force_reset_rng: bool = False,
):
    """Seed the device generator and the tracker's streams for this rank (call after initialize_model_parallel).

    Ranks default to this process's ranks in the model-parallel groups (0 when the groups do not exist).
    """
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset_rng)
    tracker = get_cuda_rng_tracker()
    # Re-seeding replaces the streams; add() refuses a name or seed that already exists.
    tracker.reset()
    set_device_rng_state(_device_rng_state_for_seed(seed))
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
    # Distinct for every (EP rank, expert-TP rank) pair while the expert-TP size stays below 100.
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + _EXPERT_PARALLEL_SEED_OFFSET + 100 * ep_rank + etp_rank)


# ---- activation recomputation --------------------------------------------------------------------------------------


class _RngSnapshot:
    """Every generator state a recomputed forward must see again: CPU, device and the tracker's streams."""

    def __init__(self):
        # Always kept: CPU-side random ops draw from it even when the model runs on an accelerator.
        self.cpu_state = torch.get_rng_state()
        on_cpu = get_current_device().type == "cpu"
        self.device_state = None if on_cpu else get_device_rng_state()
        self.tracker_states = get_cuda_rng_tracker().get_states()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_state)
        if self.device_state is not None:
            set_device_rng_state(self.device_state)
        get_cuda_rng_tracker().set_states(self.tracker_states)


class CheckpointFunction(torch.autograd.Function):
    """Run ``run_function`` without keeping its activations; rerun it (same RNG draws) during backward."""

    @staticmethod
    def forward(
        ctx: Any, run_function: Callable[[Unpack[_Ts]], _R], distribute_saved_activations: bool, *args: Unpack[_Ts]
    ) -> _R:
        ctx.run_function = run_function
        ctx.rng_snapshot = _RngSnapshot()
        # No graph is recorded: that is the memory saved; backward reruns the function with grad.
        with torch.no_grad(), _checkpointing():
            outputs = run_function(*args)

        saved = list(args)
        ctx.distributed_first_input_shape = None
        if distribute_saved_activations and group_size(resolve_tp_group()) > 1:
            if not torch.is_tensor(args[0]):
                raise TypeError(
                    "distribute_saved_activations=True splits the first argument across the tensor-parallel group, "
                    f"so it must be a tensor; got {type(args[0]).__name__}"
                )
            # Keep only this rank's 1/tp of the first input; backward all-gathers it.
            ctx.distributed_first_input_shape = args[0].shape
            # A copy, not a view: only then can the full tensor be freed once the caller drops it.
            saved[0] = split_tensor_into_1d_equal_chunks(args[0].detach(), new_buffer=True)
        _save_inputs(ctx, saved, args)
        return outputs

    @staticmethod
    def backward(ctx, *args):
        inputs = _restore_inputs(ctx)
        if ctx.distributed_first_input_shape is not None:
            first = gather_split_1d_tensor(inputs[0].detach()).view(ctx.distributed_first_input_shape)
            inputs[0] = first.requires_grad_(ctx.inputs_require_grad[0])
        outputs = _rerun(ctx.run_function, inputs, ctx.rng_snapshot)
        _backward_through(outputs, args)
        input_grads = tuple(inp.grad if torch.is_tensor(inp) and inp.requires_grad else None for inp in inputs)
        # No gradients for run_function and distribute_saved_activations.
        return (None, None) + input_grads


def _save_inputs(ctx, saved: List[Any], args: tuple) -> None:
    """Save the tensor arguments for backward and remember the others and which inputs need gradients."""
    ctx.inputs_require_grad = [torch.is_tensor(arg) and arg.requires_grad for arg in args]
    ctx.tensor_positions = [i for i, arg in enumerate(saved) if torch.is_tensor(arg)]
    ctx.other_args = [None if torch.is_tensor(arg) else arg for arg in saved]
    ctx.save_for_backward(*(saved[i] for i in ctx.tensor_positions))


def _restore_inputs(ctx) -> List[Any]:
    """The saved arguments as fresh leaves (requiring grad where the originals did) for the recomputation."""
    args = list(ctx.other_args)
    for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors):
        args[position] = tensor
    return [
        # Fresh leaves: the rerun's backward stops at them and their .grad is the input gradient.
        arg.detach().requires_grad_(needs_grad) if torch.is_tensor(arg) else arg
        for arg, needs_grad in zip(args, ctx.inputs_require_grad)
    ]


def _rerun(run_function, inputs: List[Any], rng_snapshot: "_RngSnapshot"):
    """Run ``run_function`` again with grad enabled under the RNG states of its first run, then restore the
    current states."""
    # Put the current states back afterwards so the recomputation does not shift later draws.
    states_now = _RngSnapshot()
    rng_snapshot.restore()
    try:
        with torch.enable_grad(), _checkpointing():
            outputs = run_function(*inputs)
    finally:
        states_now.restore()
    return outputs


def _backward_through(outputs, grad_outputs) -> None:
    if torch.is_tensor(outputs):
        outputs = (outputs,)
    pairs = [
        (output, grad)
        for output, grad in zip(outputs, grad_outputs)
        if torch.is_tensor(output) and output.requires_grad and grad is not None
    ]
    if pairs:
        torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])


def checkpoint(function: Callable[[Unpack[_Ts]], _R], distribute_saved_activations: bool, *args: Unpack[_Ts]) -> _R:
    """Activation recomputation: ``function(*args)`` now, its activations recomputed during backward.

    The CPU, device and tracker RNG states are saved before the forward and restored for the recomputation, so
    dropout draws the same masks. With ``distribute_saved_activations`` each tensor-parallel rank saves only its
    1/tp slice of the first argument (it is identical on every TP rank) and the slices are all-gathered in backward.
    The caller's tensor is left intact; the memory is saved once the caller drops its own reference.
    """
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """The autograd node of :class:`CheckpointWithoutOutput`: forward without keeping activations; backward
    recomputes (unless the recompute hook already did) and back-propagates through the recomputed graph."""

    @staticmethod
    def forward(
        ctx: Any,
        run_function: Callable[[Unpack[_Ts]], _R],
        checkpoint_without_output_obj: CheckpointWithoutOutput,
        *args: Unpack[_Ts],
    ) -> _R:
        checkpoint_without_output_obj.rng_snapshot = _RngSnapshot()
        with torch.no_grad(), _checkpointing():
            outputs = run_function(*args)
        _save_inputs(ctx, list(args), args)
        ctx.checkpoint_obj = checkpoint_without_output_obj
        checkpoint_without_output_obj.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *args):
        owner = ctx.checkpoint_obj
        if owner.recomputed_outputs is None:  # the output was never discarded: recompute now
            owner.recompute()
        outputs, inputs = owner.recomputed_outputs, owner.recompute_inputs
        owner.release()
        _backward_through(outputs, args)
        input_grads = tuple(inp.grad if torch.is_tensor(inp) and inp.requires_grad else None for inp in inputs)
        return (None, None) + input_grads


class CheckpointWithoutOutput:
    """Recompute a block and free its output too, not only its inner activations.

    ``out = ckpt.checkpoint(fn, *args)`` runs ``fn`` keeping only its inputs. Once ``out`` has been used by the next
    operation (whose autograd node saves ``out`` for its own backward, e.g. a linear layer),
    ``ckpt.discard_output_and_register_recompute(next_output)`` frees ``out``'s storage and registers a hook on
    ``next_output``: when backward reaches it, ``fn`` is rerun (same RNG draws) and the recomputed values are put
    back into ``out``'s storage before the next operation's backward reads them. ``fp8`` (recompute under the FP8
    autocast of the first run) is not supported yet.
    """

    def __init__(self, fp8=False):
        if fp8:
            raise ValueError("not supported yet: FP8 recomputation in CheckpointWithoutOutput (fp8=True)")
        self.fp8 = fp8
        self.run_function = None
        self.ctx = None
        self.outputs = None
        self.rng_snapshot = None
        self.recomputed_outputs = None
        self.recompute_inputs = None

    def checkpoint(self, run_function: Callable[[Unpack[_Ts]], _R], *args: Unpack[_Ts]) -> _R:
        """Run ``run_function(*args)`` without keeping its activations; return its output(s)."""
        self.run_function = run_function
        outputs = CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = outputs
        return outputs

    def _output_tensors(self) -> List[torch.Tensor]:
        outputs = (self.outputs,) if torch.is_tensor(self.outputs) else tuple(self.outputs)
        return [output for output in outputs if torch.is_tensor(output)]

    def discard_output_and_register_recompute(self, hook_tensor):
        """Free the output's storage now; recompute it when backward reaches ``hook_tensor``."""
        if self.ctx is None:
            raise RuntimeError("call checkpoint() before discard_output_and_register_recompute()")
        # An output that shares memory with an input (a view of it) must stay: freeing it would destroy the input.
        input_storages = {t.untyped_storage().data_ptr() for t in self.ctx.saved_tensors}
        for output in self._output_tensors():
            if output.untyped_storage().data_ptr() not in input_storages:
                output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute_hook)

    def _recompute_hook(self, grad):
        # Recompute once: backward() of the checkpoint node also recomputes if this hook never ran.
        if self.recomputed_outputs is None:
            self.recompute()
        return grad

    def recompute(self) -> None:
        """Rerun the function and refill the discarded outputs' storage with the recomputed values.

        The storage is refilled in place (not through the tensors), so autograd nodes that saved the outputs see
        the values again without a version-counter change.
        """
        inputs = _restore_inputs(self.ctx)
        recomputed = _rerun(self.run_function, inputs, self.rng_snapshot)
        recomputed_tensors = (
            [recomputed] if torch.is_tensor(recomputed) else [r for r in recomputed if torch.is_tensor(r)]
        )
        for output, value in zip(self._output_tensors(), recomputed_tensors):
            storage = output.untyped_storage()
            # Only discarded outputs; one that aliased an input was never freed.
            if storage.size() == 0:
                storage.resize_(value.untyped_storage().size())
                storage.copy_(value.untyped_storage())
        self.recomputed_outputs = recomputed
        self.recompute_inputs = inputs

    def release(self) -> None:
        """Drop every reference (the graph and tensors) once backward is done."""
        self.ctx = None
        self.outputs = None
        self.run_function = None
        self.recomputed_outputs = None
        self.recompute_inputs = None
