"""Which body of a fused op runs for a tensor: our Triton kernel, or the PyTorch body.

Every fused op in ``megatron.core.fusions`` has one signature and two bodies: a Triton kernel (forward and backward,
in ``fusions/kernels/``) and a PyTorch body that computes the same math (the reference, and the CPU path). The rule:

- CUDA tensor and Triton installed: the Triton kernel.
- CPU tensor: the PyTorch body, unless ``TRITON_INTERPRET=1`` was set before Triton was imported, in which case the
  Triton kernel runs in Triton's interpreter (how the kernels are tested without a GPU; far too slow for training).
  The PyTorch body runs eagerly under autograd: measured on the reference model's shapes (docs/benchmarks.md), a
  hand-written eager backward is slower on CPU than autograd's, and ``torch.compile`` (inductor) is faster per call
  but costs 5-40 s of compilation per op and shape on a cold cache, which short CPU runs and tests never earn back.
  ``MEGATRON_LITE_COMPILE_FUSIONS=1`` compiles the CPU bodies for long CPU runs.
- Anything else (CUDA without Triton, other devices, dtypes the kernels do not take): the PyTorch body, with one
  notice per fusion naming the flag that turns the fusion off.

Triton is imported only when a kernel is about to run, so importing the model costs nothing on machines without it.
"""

import functools
import importlib.util
import os
import warnings
from collections.abc import Callable

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None

# Dtypes the kernels load and store; they compute in fp32 whatever the storage type.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_noticed: set = set()


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compile_cpu_fusions() -> bool:
    """Whether the CPU bodies run through ``torch.compile`` (``MEGATRON_LITE_COMPILE_FUSIONS=1``)."""
    return os.environ.get("MEGATRON_LITE_COMPILE_FUSIONS", "0") == "1"


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=None)


def cpu_body(fn: Callable) -> Callable:
    """``fn`` as the CPU path runs it: eagerly, or compiled with ``MEGATRON_LITE_COMPILE_FUSIONS=1``."""
    return _compiled(fn) if compile_cpu_fusions() else fn


def fallback_reason(device_type: str, dtype: torch.dtype, have_triton: bool) -> str | None:
    """Why a Triton kernel cannot run for a tensor on ``device_type`` of ``dtype`` (None: it can)."""
    if device_type != "cuda":
        return f"there is no Triton kernel for {device_type} tensors"
    if not have_triton:
        return "Triton is not installed (pip install triton)"
    if dtype not in KERNEL_DTYPES:
        return f"the Triton kernel does not take {dtype} tensors"
    return None


def fallback_notice(fusion: str, message: str) -> None:
    """Warn once per fusion (``"<fusion>: <message>"``), e.g. that its PyTorch body runs instead of the kernel."""
    if fusion in _noticed:
        return
    _noticed.add(fusion)
    warnings.warn(f"{fusion}: {message}", stacklevel=3)


def pytorch_instead(reason: str, flag: str) -> str:
    """The notice for a kernel that cannot run: why, what runs instead, and the flag that turns the fusion off."""
    return f"{reason}; running the PyTorch implementation (same results). Pass {flag} to turn the fusion off"


def use_triton(x: torch.Tensor, fusion: str, flag: str) -> bool:
    """True when the Triton kernel of ``fusion`` should run for ``x``; False selects the PyTorch body (with one
    notice when ``x`` is on a device that ought to have the kernel but cannot run it)."""
    if x.device.type == "cpu":
        return HAVE_TRITON and triton_interpreting() and x.dtype in KERNEL_DTYPES
    reason = fallback_reason(x.device.type, x.dtype, HAVE_TRITON)
    if reason is None:
        return True
    fallback_notice(fusion, pytorch_instead(reason, flag))
    return False
