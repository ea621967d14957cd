"""mamba-ssm's and causal-conv1d's fused CUDA/Triton kernels, when installed: the one import guard for them.

Nothing here is required. :class:`~megatron.core.ssm.mamba_mixer.MambaMixer` uses these functions only for CUDA
tensors and only when the packages import; otherwise it runs the pure-PyTorch twins (``torch.nn.Conv1d`` and
:func:`~megatron.core.ssm.ssd_chunked.ssd_chunked_scan`, which takes the same arguments as
``mamba_chunk_scan_combined``), after one warning when the fused path was asked for.

- ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=, z=, dt_bias=, dt_softplus=, ...)``: the SSD scan;
- ``mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, ...)``: in_proj's
  output -> conv1d + SiLU -> scan -> gated RMSNorm in one autograd function (Megatron's ``use_mamba_mem_eff_path``),
  which recomputes the conv in backward instead of saving its output;
- ``causal_conv1d_fn(x, weight, bias, activation)``: the depthwise causal conv.
"""

from typing import Optional

import torch

try:
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
except ImportError:  # mamba-ssm is optional
    mamba_chunk_scan_combined = None
    mamba_split_conv1d_scan_combined = None

try:
    from causal_conv1d import causal_conv1d_fn
except ImportError:  # causal-conv1d is optional
    causal_conv1d_fn = None


def kernels_usable(tensor: Optional[torch.Tensor] = None) -> bool:
    """Whether mamba-ssm's scan kernels are installed and ``tensor`` (when given) lives on a CUDA device."""
    if mamba_chunk_scan_combined is None:
        return False
    return tensor is None or tensor.is_cuda


def conv1d_kernel_usable(tensor: torch.Tensor) -> bool:
    """Whether causal-conv1d's kernel is installed and ``tensor`` lives on a CUDA device."""
    return causal_conv1d_fn is not None and tensor.is_cuda
