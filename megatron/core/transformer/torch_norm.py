"""LayerNorm / RMSNorm from PyTorch, built the way Megatron-Core's specs ask for a norm; L2Norm for q/k."""

from typing import Protocol

import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device


class LayerNormInterface(Protocol):
    """What a norm built from a spec is: a module mapping ``x`` to the normalised ``x`` of the same shape."""

    def forward(self, x: torch.Tensor, /) -> torch.Tensor: ...


class LayerNormBuilder(Protocol):
    """What a spec's norm entry is called with (WrappedTorchNorm, L2Norm and Transformer Engine's norms fit)."""

    def __call__(self, *, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> LayerNormInterface: ...


class WrappedTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` for ``config.normalization``.

    Under sequence parallelism each rank normalises a different slice of the sequence, so the norm's parameter
    gradients are partial: the parameters are marked ``sequence_parallel=True`` for gradient finalisation to
    all-reduce them across the tensor-parallel group.
    """

    # The classes built; a subclass may build subclasses of them (e.g. with extra checkpoint state).
    _layer_norm_class = torch.nn.LayerNorm
    _rms_norm_class = torch.nn.RMSNorm

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = None,
    ):
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the PyTorch norms; set it to False")
        normalization = normalization or config.normalization
        if normalization == "LayerNorm":
            norm = cls._layer_norm_class(hidden_size, eps=eps, dtype=config.params_dtype)
        elif normalization == "RMSNorm":
            norm = cls._rms_norm_class(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization={normalization!r} is not supported; use 'LayerNorm' or 'RMSNorm'")
        norm.to(get_current_device())
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class L2Norm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, without a learnable scale (the q/k norm of ``qk_l2_norm``,
    as in Llama 4). Accepts the norm builders' keyword arguments (``config``, ...) and ignores them."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so bf16 / fp16 inputs do not lose the small mean of squares.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x)
