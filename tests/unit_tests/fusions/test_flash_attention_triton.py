"""The Triton flash-attention kernel (forward and backward; causal, grouped-query, sliding window, soft-cap,
queries continuing a cached prefix) against the explicit reference, on CPU under TRITON_INTERPRET=1, fp32 and bf16;
the ``flash`` attention backend running it inside DotProductAttention; and the kernels compiled ahead of time for
Hopper (sm_90) and Blackwell (sm_100) without a GPU, so a kernel that would not compile for a real GPU fails here.

The interpreter must be switched on before triton is imported, so those checks run in one subprocess
(``flash_attention_interpreted.py``) and this process never sees TRITON_INTERPRET.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (the `gpu` extra)")

from tests.unit_tests.fusions.flash_attention_interpreted import BF16_CASES, KERNEL_CASES  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = Path(__file__).with_name("flash_attention_interpreted.py")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_fp32_matches_reference(interpreted, case):
    errors = interpreted[f"{case}/float32"]
    assert max(errors["kernel"]) <= 1e-5, f"out, dq, dk, dv errors {errors['kernel']}"
    assert errors["lse"] <= 1e-5


@pytest.mark.parametrize("case", BF16_CASES)
def test_kernel_bf16_within_eager_bf16_error(interpreted, case):
    """bf16: within three times the eager bf16 reference's own error (both against fp64), plus 1e-2."""
    errors = interpreted[f"{case}/bfloat16"]
    for what, kernel, eager in zip(("out", "dq", "dk", "dv"), errors["kernel"], errors["eager"]):
        assert kernel <= 3 * eager + 1e-2, f"{what}: kernel {kernel:.3g} vs eager bf16 {eager:.3g}"
    assert errors["lse"] <= 1e-4


def test_flash_backend_runs_the_kernel_and_equals_unfused(interpreted):
    backend = interpreted["backend"]
    assert backend["kernel_calls"] == 2, "the flash backend with a window must take the Triton path"
    assert max(backend["training"]) <= 1e-5, f"output, dq, dk, dv errors {backend['training']}"
    assert max(backend["inference"]) <= 1e-5


def _compile(kernel, arch: int, dtype: str = "bf16"):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = dict(GROUP=2, D=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, LEFT=256, RIGHT=0, SOFTCAP=30.0)
    constants.update(PRECISION="tf32", UPCAST=False)
    pointers = {name: f"*{dtype}" for name in ("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV")}
    pointers.update(LSE="*fp32", DELTA="*fp32", scale="fp32")
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
    return triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants), target=GPUTarget("cuda", arch, 32)
    )


@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_for_gpus_ahead_of_time(arch):
    from megatron.core.fusions.kernels import flash_attention as kernels

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels are interpreted, not compiled")
    names = ["_forward_kernel", "_backward_kv_kernel", "_backward_q_kernel"] if arch == 90 else ["_forward_kernel"]
    for name in names:
        compiled = _compile(getattr(kernels, name), arch)
        assert compiled.asm.get("cubin"), f"{name}: no cubin for sm_{arch}"
