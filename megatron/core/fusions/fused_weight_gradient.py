"""Gradient-accumulation fusion: the weight-gradient GEMM of a linear layer accumulates straight into
``weight.main_grad`` (DDP's fp32 buffer), with no ``[out, in]`` temporary and no separate add.

Megatron calls apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` / ``wgrad_gemm_accum_fp16`` for
this (``main_grad``'s dtype picks which); ``wgrad_gemm_accum`` below has their semantics: the products are summed
in fp32 whatever the inputs' dtype, and stored once in ``main_grad``'s dtype. Used by the tensor-parallel linear
layers when ``gradient_accumulation_fusion`` is set and the weight has a ``main_grad``
(``--no-gradient-accumulation-fusion`` turns it off).

- CUDA: our Triton GEMM (``kernels/wgrad.py``).
- CPU: ``main_grad.addmm_(grad_output.T, input)``: the GEMM's output is ``main_grad`` itself (beta = 1). bf16 / fp16
  inputs are upcast to ``main_grad``'s dtype first: measured on 2 cores, PyTorch's bf16 GEMM on CPU is ~7x slower
  than converting both operands and running the fp32 one, and the fp32 GEMM keeps the sum in fp32 as Megatron's
  kernel does (a bf16 GEMM would round the weight gradient to bf16 before the add).
"""

import torch

from megatron.core.fusions.kernel_dispatch import KERNEL_DTYPES, use_triton

_FUSION, _FLAG = "gradient_accumulation_fusion", "--no-gradient-accumulation-fusion"


def _pytorch_wgrad_accum(grad_output: torch.Tensor, input: torch.Tensor, main_grad: torch.Tensor) -> None:
    if grad_output.dtype != main_grad.dtype:
        grad_output = grad_output.to(main_grad.dtype)
    if input.dtype != main_grad.dtype:
        input = input.to(main_grad.dtype)
    main_grad.addmm_(grad_output.t(), input)


def wgrad_gemm_accum(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input`` in place, summed in fp32.

    ``input`` is ``[..., in]`` and ``grad_output`` ``[..., out]`` over the same leading (token) axes; ``main_grad``
    is the ``[out, in]`` gradient buffer (fp32, bf16 or fp16). The argument order is apex's.
    """
    input = input.reshape(-1, input.shape[-1])
    grad_output = grad_output.reshape(-1, grad_output.shape[-1])
    if input.dtype != grad_output.dtype:
        input = input.to(grad_output.dtype)
    if use_triton(grad_output, _FUSION, _FLAG) and main_grad.dtype in KERNEL_DTYPES:
        from megatron.core.fusions.kernels.wgrad import wgrad_accumulate

        wgrad_accumulate(grad_output, input, main_grad)
        return
    _pytorch_wgrad_accum(grad_output, input, main_grad)
