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
"""

import contextlib
from typing import Any, Dict, Optional

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

# Megatron's seed offsets: fixed so that runs are reproducible across implementations.
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


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

    def __init__(self):
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
) -> None:
    """Create the global tracker (again when ``force_reset`` or when a different kind is asked for).

    Transformer Engine's tracker and CUDA-graph-safe generator states are GPU accelerators that are not available
    here; asking for them warns once and uses the plain tracker, which draws the same streams.
    """
    global _CUDA_RNG_STATE_TRACKER
    if use_te_rng_tracker:
        warn_once("use_te_rng_tracker=True needs Transformer Engine; using megatron-lite's CudaRNGStatesTracker")
    if use_cudagraphable_rng:
        warn_once("use_cudagraphable_rng=True is a CUDA-graph feature that is not available; using the plain tracker")
    kind = InferenceCudaRNGStatesTracker if inference_rng_tracker else CudaRNGStatesTracker
    if force_reset or type(_CUDA_RNG_STATE_TRACKER) is not kind:
        _CUDA_RNG_STATE_TRACKER = kind()


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
) -> CudaRNGStatesTracker:
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
) -> None:
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
    tracker.reset()
    set_device_rng_state(_device_rng_state_for_seed(seed))
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + _EXPERT_PARALLEL_SEED_OFFSET + 100 * ep_rank + etp_rank)


# ---- activation recomputation --------------------------------------------------------------------------------------


class _RngSnapshot:
    """Every generator state a recomputed forward must see again: CPU, device and the tracker's streams."""

    def __init__(self):
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
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.rng_snapshot = _RngSnapshot()
        with torch.no_grad():
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
            saved[0] = split_tensor_into_1d_equal_chunks(args[0].detach(), new_buffer=True)
        ctx.inputs_require_grad = [torch.is_tensor(arg) and arg.requires_grad for arg in args]
        ctx.tensor_positions = [i for i, arg in enumerate(saved) if torch.is_tensor(arg)]
        ctx.other_args = [None if torch.is_tensor(arg) else arg for arg in saved]
        ctx.save_for_backward(*(saved[i] for i in ctx.tensor_positions))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = list(ctx.other_args)
        for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[position] = tensor
        if ctx.distributed_first_input_shape is not None:
            args[0] = gather_split_1d_tensor(args[0]).view(ctx.distributed_first_input_shape)
        inputs = [
            arg.detach().requires_grad_(needs_grad) if torch.is_tensor(arg) else arg
            for arg, needs_grad in zip(args, ctx.inputs_require_grad)
        ]

        states_now = _RngSnapshot()
        ctx.rng_snapshot.restore()
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            states_now.restore()

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [
            (output, grad)
            for output, grad in zip(outputs, grad_outputs)
            if torch.is_tensor(output) and output.requires_grad
        ]
        if pairs:
            torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
        input_grads = tuple(inp.grad if torch.is_tensor(inp) and inp.requires_grad else None for inp in inputs)
        return (None, None) + input_grads


def checkpoint(function, distribute_saved_activations: bool, *args: Any):
    """Activation recomputation: ``function(*args)`` now, its activations recomputed during backward.

    The CPU, device and tracker RNG states are saved before the forward and restored for the recomputation, so
    dropout draws the same masks. With ``distribute_saved_activations`` each tensor-parallel rank saves only its
    1/tp slice of the first argument (it is identical on every TP rank) and the slices are all-gathered in backward.
    The caller's tensor is left intact; the memory is saved once the caller drops its own reference.
    """
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
