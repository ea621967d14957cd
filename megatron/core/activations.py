"""Activation functions Megatron-Core names that torch does not provide directly."""

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer; ``--squared-relu``)."""
    return torch.pow(F.relu(x), 2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), the GELU approximation used by CLIP."""
    return x * torch.sigmoid(1.702 * x)


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU: 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
