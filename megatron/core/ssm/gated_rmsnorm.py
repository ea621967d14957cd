"""The gated RMSNorm that closes a Mamba-2 mixer: RMS-normalise over groups of channels, gate by SiLU(z).

``norm_before_gate=False`` (Megatron's default): ``rmsnorm(y * silu(z)) * weight``;
``norm_before_gate=True``: ``rmsnorm(y) * weight * silu(z)``. The root mean square is taken separately over each
group of ``group_size`` consecutive channels (the mixer's ``d_inner / ngroups``), so a group lives wholly on one
tensor-parallel rank and the norm needs no communication. It is computed in fp32 and returned in the input's dtype.
"""

from typing import Optional

import torch
import torch.nn.functional as F


class GatedRMSNorm(torch.nn.Module):
    """``forward(y, z)`` over the last axis of ``y`` (``hidden_size`` channels: this rank's part of ``d_inner``).

    The weight is split over tensor-parallel ranks like the channels it scales (``tensor_model_parallel`` set); the
    mixer that owns the norm stores it split along axis 0.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: Optional[int] = None,
        norm_before_gate: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        group_size = hidden_size if group_size is None else group_size
        if group_size < 1 or hidden_size % group_size != 0:
            raise ValueError(
                f"GatedRMSNorm: hidden_size ({hidden_size}) must be a positive multiple of group_size ({group_size})"
            )
        self.hidden_size, self.eps, self.group_size = hidden_size, eps, group_size
        self.norm_before_gate = norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 0
        self.weight.partition_stride = 1

    def forward(self, y: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        out_dtype = y.dtype
        y = y.float()
        gate = None if z is None else F.silu(z.float())
        if gate is not None and not self.norm_before_gate:
            y = y * gate
        grouped = y.view(*y.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        y = grouped.view_as(y) * self.weight.float()
        if gate is not None and self.norm_before_gate:
            y = y * gate
        return y.to(out_dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
            f"norm_before_gate={self.norm_before_gate}"
        )
