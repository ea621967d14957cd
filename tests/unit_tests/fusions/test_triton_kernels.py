"""Our Triton kernels without a GPU: each one runs in Triton's interpreter against its PyTorch reference (forward
and backward, fp32 and bf16), and compiles ahead of time for Hopper (sm_90) and Blackwell (sm_100)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.fusions.kernel_dispatch import HAVE_TRITON, triton_interpreting

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed (pip install triton)")

REPO_ROOT = Path(__file__).resolve().parents[3]
FUSIONS = ("bias_swiglu", "swiglu", "bias_gelu", "LayerNorm", "RMSNorm", "cross_entropy", "rope", "wgrad_accum")
FUSIONS += ("softmax_causal", "softmax_masked", "softmax_padding", "softmax")
FUSIONS += ("bias_dropout_add_p0", "bias_dropout_add_inference")
DTYPES = ("float32", "bfloat16")
# Checks that are not a comparison per dtype (dropout's mask: kept fraction, scaling, backward, seeds).
CHECKS = ("bias_dropout_add_p0_exact", "bias_dropout_add_rng_tracker", "bias_dropout_add_p0.3")
CHECKS += ("bias_dropout_add_p0.75",)


def _run_checks(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    script = Path(__file__).with_name("interpreter_checks.py")
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def interpreter_results():
    """One interpreter run for all kernels (a subprocess: TRITON_INTERPRET must be set before Triton is imported)."""
    return _run_checks()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", FUSIONS)
def test_kernel_matches_reference_in_interpreter(interpreter_results, fusion, dtype):
    case = f"{fusion}/{dtype}"
    assert case in interpreter_results, f"the interpreter run did not check {case}"
    assert interpreter_results[case] is None, interpreter_results[case]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_check_in_interpreter(interpreter_results, check):
    assert check in interpreter_results, f"the interpreter run did not run {check}"
    assert interpreter_results[check] is None, interpreter_results[check]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernels_match_reference_on_cuda():
    """The same checks with the kernels compiled for this GPU and run on CUDA tensors (benchmarks/gpu_check.sh)."""
    results = _run_checks("--cuda")
    missing = {f"{fusion}/{dtype}" for fusion in FUSIONS for dtype in DTYPES} - results.keys()
    assert not missing, f"the CUDA run did not check {sorted(missing)}"
    failures = {case: message for case, message in results.items() if message is not None}
    assert not failures, failures


def _aot_kernels():
    if not HAVE_TRITON:
        return []
    from megatron.core.fusions.kernels import (
        activations,
        bias_dropout,
        cross_entropy,
        moe_permute,
        moe_router,
        norm,
        rope,
        softmax,
        wgrad,
    )

    kernels = []
    for module in (activations, norm, cross_entropy, rope, softmax, bias_dropout, moe_permute, moe_router, wgrad):
        for kernel, signature, constexprs in module.AOT_SIGNATURES:
            name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
            suffix = "".join(f"-{k}={v}" for k, v in constexprs.items() if k != "BLOCK")
            kernels.append(pytest.param(kernel, signature, constexprs, id=f"{name}{suffix}"))
    return kernels


@pytest.mark.parametrize("arch", (90, 100), ids=("sm_90", "sm_100"))
@pytest.mark.parametrize("kernel,signature,constexprs", _aot_kernels())
def test_kernel_compiles_for_gpu(kernel, signature, constexprs, arch):
    if triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 in this process: Triton builds interpreter functions, which do not compile")
    import triton
    from triton.backends.compiler import GPUTarget

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend to compile for")
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    assert compiled.asm["cubin"], f"no cubin for sm_{arch}"
