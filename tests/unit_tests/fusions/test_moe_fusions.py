"""The MoE fusions (``--moe-permute-fusion``, ``--moe-router-fusion``): their Triton kernels in Triton's interpreter
against ``moe_utils``' PyTorch code (moe_interpreter_checks.py: forward and backward, fp32 and bf16, ties and tokens
dropped by capacity, and a whole MoE layer with the fusions on against it with them off), and the dispatch rule
(CPU runs the PyTorch code without a notice; a device without the kernel says so once)."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron.core.fusions import fused_moe_permute, fused_moe_router, kernel_dispatch
from megatron.core.fusions.kernel_dispatch import HAVE_TRITON
from megatron.core.transformer.moe import moe_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
KERNEL_CASES = ("permute_probs", "permute", "permute_drop_and_pad")
KERNEL_CASES += ("router_softmax", "router_softmax_ties", "router_pre_softmax", "router_sigmoid_bias")
KERNEL_CASES += ("router_sigmoid_ties", "router_sqrtsoftplus_top1")
KERNEL_CASES += ("aux_scores_softmax", "aux_scores_sigmoid", "aux_scores_sqrtsoftplus")
CASES = [f"{name}/{dtype}" for name in KERNEL_CASES for dtype in ("float32", "bfloat16")]
CASES += ["layer_alltoall_capacity/float32", "layer_allgather_sigmoid_bias/float32"]


@pytest.fixture(scope="module")
def interpreter_results():
    """One interpreter run for every case (a subprocess: TRITON_INTERPRET must be set before Triton is imported)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    script = Path(__file__).with_name("moe_interpreter_checks.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed (pip install triton)")
@pytest.mark.parametrize("case", CASES)
def test_moe_kernel_matches_pytorch_in_interpreter(interpreter_results, case):
    assert case in interpreter_results, f"the interpreter run did not check {case}"
    assert interpreter_results[case] is None, interpreter_results[case]


def test_cpu_runs_the_pytorch_code_without_a_notice(monkeypatch):
    monkeypatch.setattr(kernel_dispatch, "_noticed", set())
    generator = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(6, 4, generator=generator), torch.randn(6, 8, generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused = moe_utils.topk_routing_with_score_function(logits, 2, fused=True)
        permuted, _, indices, _, _ = moe_utils.permute(tokens, fused[1], num_out_tokens=12, fused=True)
        restored = moe_utils.unpermute(permuted, indices, tokens.shape, fused=True)
    assert indices.dim() == 1  # PyTorch's sorted indices, not the kernel's row map
    for mine, theirs in zip(fused, moe_utils.topk_routing_with_score_function(logits, 2)):
        assert torch.equal(mine, theirs)
    assert torch.allclose(restored, tokens * 2)


def test_a_device_without_the_kernel_says_so_once(monkeypatch):
    monkeypatch.setattr(kernel_dispatch, "_noticed", set())
    meta = torch.empty(6, 4, device="meta")
    with pytest.warns(UserWarning) as record:
        assert not fused_moe_permute.permute_kernel_available(meta)
        assert not fused_moe_permute.permute_kernel_available(meta)
        assert not fused_moe_router.router_kernel_available(meta)
    assert [str(w.message) for w in record] == [
        "moe_permute_fusion: there is no Triton kernel for meta tensors; running the PyTorch implementation (same "
        "results). Pass no --moe-permute-fusion to turn the fusion off",
        "moe_router_fusion: there is no Triton kernel for meta tensors; running the PyTorch implementation (same "
        "results). Pass no --moe-router-fusion to turn the fusion off",
    ]


def test_group_limited_routing_runs_pytorch_with_a_notice_where_a_kernel_would(monkeypatch):
    monkeypatch.setattr(kernel_dispatch, "_noticed", set())
    with pytest.warns(UserWarning, match="moe_router_fusion: group-limited top-k .* has no kernel; running the Py"):
        assert not fused_moe_router.router_kernel_available(torch.empty(6, 8, device="meta"), group_topk=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on CPU the PyTorch code is the path, not a fallback
        assert not fused_moe_router.router_kernel_available(torch.empty(6, 8), group_topk=2)
