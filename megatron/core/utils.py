"""Device helpers and small shared utilities.

Library code never calls ``.cuda()`` or ``torch.cuda.*`` directly: it asks these helpers, so every code path runs on
CPU (gloo) as well as on NVIDIA GPUs (nccl).
"""

import asyncio
import functools
import contextlib
import importlib
import importlib.metadata
import inspect
import logging
import math
import traceback
import warnings
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, TypeVar, Union

import torch
from packaging.version import Version as PkgVersion

# Megatron's public path for the API life-cycle decorators, kept in a leaf of their own.
from megatron.core._api_lifecycle import (  # noqa: F401
    ExperimentalNotEnabledError,
    deprecate_args,
    deprecated,
    experimental_api,
    experimental_cls,
    experimental_fn,
    internal_api,
    null_decorator,
)
from megatron.core.public_api import public_names

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

# packaging is a hard dependency here (imported above); Megatron's flag for it stays for code that checks it.
HAVE_PACKAGING = True

_Wrapped = TypeVar("_Wrapped", bound=Callable[..., Any])

# Names that moved to the module owning their concept, which sits above this leaf: Megatron's import path keeps
# working through a lookup on first use (PEP 562). Code in this repository imports the new home.
_MOVED = {
    "get_tensor_model_parallel_group_if_none": "megatron.core.parallel_state",
    "log_on_each_pipeline_stage": "megatron.core.parallel_state",
    "make_sharded_tensor_for_checkpoint": "megatron.core.tensor_parallel.sharded_state",
    "make_tp_sharded_tensor_for_checkpoint": "megatron.core.tensor_parallel.sharded_state",
    "get_batch_on_this_tp_rank": "megatron.core.tensor_parallel.data",
    "prepare_input_tensors_for_wgrad_compute": "megatron.core.tensor_parallel.deferred_wgrad",
    "drain_embedding_wgrad_compute": "megatron.core.tensor_parallel.deferred_wgrad",
    "chunks_of_cp_rank": "megatron.core.transformer.context_parallel.batch",
    "get_batch_on_this_cp_rank": "megatron.core.transformer.context_parallel.batch",
    "check_param_hashes_across_dp_replicas": "megatron.core.distributed.param_hashes",
    "StragglerDetector": "megatron.core.straggler_detector",
}


def __getattr__(name):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def get_current_device() -> torch.device:
    """The device this rank computes on: its CUDA device when CUDA is available, else the CPU; the meta device
    inside ``with torch.device("meta")``, where a model is built for its structure only (checkpoint converters)."""
    if torch.get_default_device().type == "meta":
        return torch.device("meta")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_device_for_rank(local_rank: int) -> None:
    """Bind this process to its local GPU, when there is one."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def synchronize_device() -> None:
    """Wait for the accelerator's queued work (nothing to wait for on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_buffer_like(tensor: torch.Tensor, pin: bool = True, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An empty host tensor shaped like ``tensor``: page-locked when CUDA is available and ``pin`` is set, so that
    copies to and from the accelerator can run asynchronously (``non_blocking=True``); ordinary memory otherwise."""
    pin = pin and torch.cuda.is_available()
    return torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device="cpu", pin_memory=pin)


def side_stream():
    """A new CUDA stream for copies that overlap the current stream's work; None without CUDA (every copy is
    then synchronous host memory traffic)."""
    return torch.cuda.Stream() if torch.cuda.is_available() else None


def stream_context(stream):
    """``with stream_context(s):`` runs the block on stream ``s`` (a no-op context for None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def wait_stream(waiting, stream) -> None:
    """Make ``waiting`` (None: the current stream) wait for the work queued on ``stream`` (None: nothing)."""
    if stream is not None:
        (waiting or torch.cuda.current_stream()).wait_stream(stream)


def device_memory_mb() -> Optional[dict]:
    """Allocated, peak-allocated and reserved accelerator memory in MB (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    mb = 1024 * 1024
    return {
        "allocated": torch.cuda.memory_allocated() / mb,
        "max allocated": torch.cuda.max_memory_allocated() / mb,
        "reserved": torch.cuda.memory_reserved() / mb,
    }


def ensure_divisibility(numerator, denominator):
    """Raise when ``denominator`` does not divide ``numerator``."""
    if denominator == 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator, denominator):
    """Exact integer division; raises when ``denominator`` does not divide ``numerator``."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


@lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    """Emit ``message`` as a warning the first time it is seen in this process."""
    warnings.warn(message, stacklevel=3)


def print_rank_0(message: str) -> None:
    """Print from global rank 0 only (or always, before torch.distributed is initialised)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(message, flush=True)


def init_method_normal(sigma: float):
    """Init method drawing from N(0, sigma^2)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """Init method for output projections: N(0, (sigma / sqrt(multiplier * num_layers))^2), as in GPT-2/Megatron."""
    return init_method_normal(sigma / (multiplier * num_layers) ** 0.5)


@contextmanager
def layout_independent_init(config, stream_offset: int):
    """Draw the weights of the module built inside from its own CPU random stream when CPU initialisation is on.

    With ``config.use_cpu_initialization`` every full weight is created on the CPU and then split over tensor-parallel
    ranks. Seeding each module's draws from ``(base seed + stream_offset)`` — the embedding 0, transformer layer n
    (1-based, global) n, the output layer ``num_layers + 1`` — also makes the weights independent of which pipeline
    stage builds the module, so every TP/PP/VPP layout assembles the same model from the same seed. The base seed is
    the one last given to ``torch.manual_seed``; the caller's random state is restored afterwards.
    """
    if not config.use_cpu_initialization:
        yield
        return
    base_seed = torch.initial_seed()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base_seed + stream_offset)
        yield


def mup_scaled_init_method_normal(sigma, num_layers, width_mult, multiplier=2.0):
    """muP version of :func:`scaled_init_method_normal`: the depth-scaled std is further divided by
    ``sqrt(width_mult)`` (hidden weights' std shrinks as ``1/sqrt(fan_in)`` when the model is widened)."""
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers * width_mult))


def round_up_to_nearest_multiple(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return ((value + multiple - 1) // multiple) * multiple


# ---- models and wrappers ---------------------------------------------------------------------------------------


def get_attr_wrapped_model(model, attr, allow_none=True, return_model_obj=False):
    """Get ``attr`` from ``model``, looking through wrappers (DDP, Float16Module) that keep the real model
    in ``.module``.

    With ``allow_none=False`` a wrapper whose ``attr`` is None does not count as having it. With ``return_model_obj``
    the (possibly inner) module that has ``attr`` is returned instead of the attribute.
    """
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model takes a single model chunk, not a list")

    def has(module):
        return hasattr(module, attr) and (allow_none or getattr(module, attr) is not None)

    while not has(model):
        if not hasattr(model, "module"):
            raise RuntimeError(f"couldn't find attribute {attr!r} in {type(model).__name__} or any wrapped module")
        model = model.module
    return model if return_model_obj else getattr(model, attr)


def get_model_type(model):
    return get_attr_wrapped_model(model, "model_type")


def get_model_xattn(model):
    """Whether the model needs cross-attention inputs (its ``xattn_needed``); False for models without the notion."""
    try:
        return get_attr_wrapped_model(model, "xattn_needed")
    except RuntimeError:
        return False


def get_model_config(model):
    return get_attr_wrapped_model(model, "config", allow_none=False)


def unwrap_model(model, module_instances=None):
    """Strip wrapper modules (by default Megatron's DDP, torch's DDP and Float16Module) off a model or a list of
    model chunks, returning the inner module(s)."""

    # Megatron's wrappers say so with a class attribute, so this leaf module need not import the classes.
    def is_wrapper(chunk) -> bool:
        if module_instances is not None:
            return isinstance(chunk, tuple(module_instances))
        return isinstance(chunk, torch.nn.parallel.DistributedDataParallel) or getattr(
            type(chunk), "_megatron_model_wrapper", False
        )

    chunks = model if isinstance(model, list) else [model]
    unwrapped = []
    for chunk in chunks:
        while is_wrapper(chunk):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped if isinstance(model, list) else unwrapped[0]


def is_submodule(module, parent_module, strict=True):
    """True when ``module`` is inside ``parent_module``; with ``strict=False`` the parent itself counts too."""
    if not strict and module is parent_module:
        return True
    return any(child is module for child in parent_module.modules() if child is not parent_module)


def accepts_parameter(func: Callable, name: str) -> bool:
    """Whether ``func`` can be called with the keyword argument ``name`` (directly or through ``**kwargs``)."""
    parameters = inspect.signature(func).parameters
    if name in parameters:
        return parameters[name].kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def is_using_quantization_scales(config):
    """True when the config trains in FP8 or FP4, whose tensors carry quantisation scales."""
    return bool(getattr(config, "fp8", None)) or bool(getattr(config, "fp4", None))


# ---- process-group helpers -------------------------------------------------------------------------------------


def get_pg_size(group=None):
    """Size of ``group``; None is torch.distributed's default group (the world), as in torch. 1 when
    torch.distributed is not initialised."""
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


def get_pg_rank(group=None):
    """This rank's rank in ``group`` (the world when None); 0 when torch.distributed is not initialised."""
    if not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group)


def get_pg_src_rank(group=None):
    """Global rank of rank 0 of ``group`` (the world when None); 0 when torch.distributed is not initialised."""
    if not torch.distributed.is_initialized():
        return 0
    if group is None:
        return 0
    return torch.distributed.get_process_group_ranks(group)[0]


# ---- DTensor helpers -------------------------------------------------------------------------------------------


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def to_local_if_dtensor(tensor: Union[torch.Tensor, "DTensor"]) -> torch.Tensor:
    """This rank's local piece of a DTensor (a plain tensor is returned as is)."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def get_full_tensor_if_necessary(tensor):
    """The whole tensor behind a DTensor, gathered from its shards (a plain tensor is returned as is)."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def as_dtensor_like(tensor: torch.Tensor, like: Union[torch.Tensor, "DTensor"]) -> torch.Tensor:
    """``tensor`` as a DTensor laid out like ``like`` (a parameter sharded by FSDP2), from either this rank's local
    piece or the whole tensor; returned as is when ``like`` is a plain tensor or ``tensor`` already a DTensor. No
    communication: a whole tensor is cut locally (every rank holds it)."""
    if not _is_dtensor(like) or _is_dtensor(tensor):
        return tensor
    from torch.distributed.tensor import DTensor, distribute_tensor

    local_shape = like.to_local().shape
    if tuple(tensor.shape) == tuple(local_shape):
        return DTensor.from_local(
            tensor, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    if tuple(tensor.shape) == tuple(like.shape):
        return distribute_tensor(tensor, like.device_mesh, like.placements, src_data_rank=None)
    raise ValueError(
        f"a tensor of shape {tuple(tensor.shape)} cannot be loaded into a DTensor of global shape "
        f"{tuple(like.shape)} whose local piece is {tuple(local_shape)}"
    )


def get_data_parallel_group_if_dtensor(
    tensor: Union[torch.Tensor, "DTensor"], data_parallel_group: "ProcessGroup" = None
) -> Optional["ProcessGroup"]:
    """The group a (1-D mesh) DTensor is sharded over, checked against ``data_parallel_group`` when both are given;
    ``data_parallel_group`` for a plain tensor."""
    if not _is_dtensor(tensor):
        return data_parallel_group
    group = tensor.device_mesh.get_group()
    if data_parallel_group is not None and group != data_parallel_group:
        raise ValueError("the DTensor's mesh group is not the data_parallel_group given")
    return group


# ---- viewless tensors ------------------------------------------------------------------------------------------


def _kernel_make_viewless_tensor(inp, requires_grad):
    """A new tensor sharing ``inp``'s storage but with no ``._base``, so it keeps no view chain alive."""
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class MakeViewlessTensor(torch.autograd.Function):
    """Autograd-transparent version of :func:`_kernel_make_viewless_tensor` (the gradient passes through)."""

    @staticmethod
    def forward(ctx, inp, requires_grad):
        return _kernel_make_viewless_tensor(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def make_viewless_tensor(inp, requires_grad, keep_graph):
    """Return ``inp`` without a ``._base`` (itself when it is not a view).

    Pipeline stages free a layer's output storage after sending it; if the output is a view, its base would keep the
    memory alive. ``keep_graph`` keeps the autograd connection to ``inp``.
    """
    if inp._base is None:
        return inp
    if keep_graph:
        return MakeViewlessTensor.apply(inp, requires_grad)
    return _kernel_make_viewless_tensor(inp, requires_grad)


def assert_viewless_tensor(tensor, extra_msg=None):
    """Raise when ``tensor`` (or any tensor of a list of them) is a view; non-tensors are ignored."""
    if isinstance(tensor, list):
        for item in tensor:
            assert_viewless_tensor(item, extra_msg)
        return tensor
    if not isinstance(tensor, torch.Tensor):
        return tensor
    if tensor._base is not None:
        raise AssertionError(
            "Ensure tensor._base is None before setting tensor.data or storing tensor to memory buffer. "
            f"Otherwise, a memory leak will occur (and likely accumulate over iterations). {extra_msg or ''}"
        )
    return tensor


def safely_set_viewless_tensor_data(tensor, new_data_tensor):
    """``tensor.data = new_data_tensor`` after checking that ``tensor`` is not a view."""
    assert_viewless_tensor(
        tensor,
        extra_msg=f"FYI, tensor._base has shape {'--' if tensor._base is None else tensor._base.shape}, "
        f"and new_data_tensor "
        f"has shape {new_data_tensor.shape}.",
    )
    tensor.data = new_data_tensor


class WrappedTensor:
    """Holds a tensor so a callee can take the only reference (``unwrap``) and free it early."""

    def __init__(self, tensor: torch.Tensor):
        self._wrapper = [tensor]

    def unwrap(self):
        """Return the tensor and drop this wrapper's reference to it (a second call is an error)."""
        if not self._wrapper:
            raise RuntimeError("WrappedTensor was already unwrapped")
        return self._wrapper.pop()


class GlobalMemoryBuffer:
    """Named scratch tensors reused across calls, so hot paths (e.g. all-gather outputs) do not reallocate.

    ``get_tensor(shape, dtype, name)`` returns a view of the buffer kept under ``(name, dtype)``, grown when a larger
    request comes. Two live uses must use different names: the same name returns the same memory.
    """

    def __init__(self):
        self.buffer: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context: Optional[Callable] = None):
        """A tensor of ``tensor_shape`` and ``dtype`` backed by the ``name`` buffer (contents are unspecified).

        ``mem_alloc_context``, when given, is a context-manager factory entered around a (re)allocation, e.g. to
        place the buffer in a particular memory pool.
        """
        required = math.prod(tensor_shape)
        key = (name, dtype)
        current = self.buffer.get(key)
        if current is None or current.numel() < required:
            context = mem_alloc_context() if mem_alloc_context is not None else _null_context()
            with context:
                self.buffer[key] = torch.empty(required, dtype=dtype, device=get_current_device(), requires_grad=False)
        return self.buffer[key][0:required].view(*tensor_shape)


@contextmanager
def _null_context():
    yield


# ---- versions of optional packages -----------------------------------------------------------------------------
# get_*_version returns the installed version as a packaging Version, or None when the package is absent;
# is_*_min_version is then False (an absent package satisfies no minimum).


@lru_cache(maxsize=None)
def _installed_version(*distribution_names: str) -> Optional[PkgVersion]:
    for name in distribution_names:
        try:
            return PkgVersion(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _is_min_version(installed: Optional[PkgVersion], version, check_equality: bool) -> bool:
    if installed is None:
        return False
    wanted = PkgVersion(str(version))
    return installed >= wanted if check_equality else installed > wanted


def get_torch_version():
    """The running torch's version (local build tags such as ``+cpu`` kept)."""
    return PkgVersion(torch.__version__)


def is_torch_min_version(version, check_equality=True):
    return _is_min_version(get_torch_version(), version, check_equality)


def get_te_version():
    """Transformer Engine's version, or None when it is not installed."""
    return _installed_version("transformer-engine", "transformer_engine")


def is_te_min_version(version, check_equality=True):
    return _is_min_version(get_te_version(), version, check_equality)


def get_fa_version():
    """flash-attn's version, or None when it is not installed."""
    return _installed_version("flash-attn", "flash_attn")


def is_fa_min_version(version, check_equality=True):
    return _is_min_version(get_fa_version(), version, check_equality)


def get_mamba_version():
    """mamba-ssm's version, or None when it is not installed."""
    return _installed_version("mamba-ssm", "mamba_ssm")


def is_mamba_min_version(version, check_equality=True):
    return _is_min_version(get_mamba_version(), version, check_equality)


def get_causal_conv1d_version():
    """causal-conv1d's version, or None when it is not installed."""
    return _installed_version("causal-conv1d", "causal_conv1d")


def is_causal_conv1d_min_version(version, check_equality=True):
    return _is_min_version(get_causal_conv1d_version(), version, check_equality)


def get_flashinfer_version():
    """FlashInfer's version, or None when it is not installed."""
    return _installed_version("flashinfer-python", "flashinfer")


def is_flashinfer_min_version(version, check_equality=True):
    return _is_min_version(get_flashinfer_version(), version, check_equality)


def deprecate_inference_params(inference_context, inference_params):
    """The inference context given either way: ``inference_params`` is the deprecated name of ``inference_context``."""
    if inference_context is None and inference_params is not None:
        warnings.warn(
            "`inference_params` renamed to `inference_context`, and will be removed in `megatron-core` 0.13.",
            DeprecationWarning,
            stacklevel=2,
        )
        return inference_params
    return inference_context


# ---- profiling ranges ------------------------------------------------------------------------------------------
# Off by default. When enabled, ranges are NVTX ranges on CUDA and torch.profiler record_function ranges on the CPU,
# so they show up in Nsight Systems and in torch.profiler traces respectively.

_NVTX_ENABLED = False
_OPEN_RANGES: List[Tuple[str, Any]] = []


def configure_nvtx_profiling(enabled: bool) -> None:
    global _NVTX_ENABLED
    _NVTX_ENABLED = bool(enabled)


def _range_name(msg, suffix) -> str:
    name = msg if msg is not None else "range"
    return f"{name}.{suffix}" if suffix is not None else name


def nvtx_range_push(msg=None, suffix=None) -> None:
    """Open a profiling range named ``msg`` (``msg.suffix`` with a suffix), when profiling ranges are enabled."""
    if not _NVTX_ENABLED:
        return
    name = _range_name(msg, suffix)
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
        _OPEN_RANGES.append((name, None))
    else:
        cpu_range = torch.autograd.profiler.record_function(name)
        cpu_range.__enter__()
        _OPEN_RANGES.append((name, cpu_range))


def nvtx_range_pop(msg=None, suffix=None) -> None:
    """Close the innermost open range; ``msg``/``suffix``, when given, must name it."""
    if not _NVTX_ENABLED:
        return
    if not _OPEN_RANGES:
        raise RuntimeError("nvtx_range_pop without a matching nvtx_range_push")
    name, cpu_range = _OPEN_RANGES.pop()
    if msg is not None and _range_name(msg, suffix) != name:
        raise RuntimeError(f"nvtx_range_pop({_range_name(msg, suffix)!r}) but the innermost open range is {name!r}")
    if cpu_range is None:
        torch.cuda.nvtx.range_pop()
    else:
        cpu_range.__exit__(None, None, None)


def nvtx_decorator(message: Optional[str] = None) -> Callable[[_Wrapped], _Wrapped]:
    """Decorator: run the function inside a profiling range (named ``message`` or the function's qualified name)."""

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            nvtx_range_push(message or func.__qualname__)
            try:
                return func(*args, **kwargs)
            finally:
                nvtx_range_pop()

        return wrapper

    return decorate


# ---- apex multi_tensor_applier replacements --------------------------------------------------------------------


def local_multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args):
    """Pure-PyTorch stand-in for apex's ``multi_tensor_applier``: call ``op`` on the whole lists at once."""
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The L2 norm of all tensors of ``tensor_lists[0]`` together (shape [1], fp32), and, with ``per_tensor``,
    each tensor's norm (else None)."""
    tensors = tensor_lists[0]
    if not tensors:
        device = get_current_device()
        return torch.zeros(1, dtype=torch.float32, device=device), None
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, (norms if per_tensor else None)


def local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``dst = src * scale`` for each pair of ``zip(tensor_lists[0], tensor_lists[1])``."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        dst.copy_(src * scale)


def get_asyncio_loop(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.AbstractEventLoop:
    """``loop`` if given, else this thread's running or current event loop, creating and installing one if none."""
    if loop is not None:
        return loop
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            loop = asyncio.get_event_loop()
        if not loop.is_closed():
            return loop
    except RuntimeError:
        pass
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop


def trace_async_exceptions(func: Optional[Callable] = None, *, verbose: bool = False):
    """Decorator for coroutine functions and async generators: an exception escaping them is logged with its
    traceback before it propagates, so failures inside background tasks are not lost. ``verbose`` also logs entry
    and exit."""

    def decorate(fn):
        name = fn.__qualname__
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def agen_wrapper(*args, **kwargs):
                if verbose:
                    logger.info("entering %s", name)
                try:
                    async for item in fn(*args, **kwargs):
                        yield item
                except Exception:
                    logger.error("exception in %s:\n%s", name, traceback.format_exc())
                    raise
                finally:
                    if verbose:
                        logger.info("leaving %s", name)

            return agen_wrapper
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"trace_async_exceptions decorates async functions, not {name}")

        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            if verbose:
                logger.info("entering %s", name)
            try:
                return await fn(*args, **kwargs)
            except Exception:
                logger.error("exception in %s:\n%s", name, traceback.format_exc())
                raise
            finally:
                if verbose:
                    logger.info("leaving %s", name)

        return wrapper

    return decorate(func) if func is not None else decorate


# Star imports and API listings see the _MOVED names too.
__all__ = public_names(globals(), _MOVED)
