"""LayerNorm / RMSNorm from PyTorch, built the way Megatron-Core's specs ask for a norm; L2Norm for q/k."""

from typing import Protocol

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_layer_norm import fused_norm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device


class LayerNormInterface(Protocol):
    """What a norm built from a spec is: a module mapping ``x`` to the normalised ``x`` of the same shape."""

    def forward(self, x: torch.Tensor, /) -> torch.Tensor: ...


class LayerNormBuilder(Protocol):
    """What a spec's norm entry is called with (WrappedTorchNorm, L2Norm and Transformer Engine's norms fit)."""

    def __call__(self, *, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> LayerNormInterface: ...


def normalize(
    x, normalization: str, weight, bias, eps: float, zero_centered_gamma: bool = False, fused: bool = False
) -> torch.Tensor:
    """LayerNorm or RMSNorm of ``x`` over its last axis. With ``zero_centered_gamma`` (Megatron's
    ``--apply-layernorm-1p``) the stored ``weight`` is gamma - 1: it starts at zero, and weight decay pulls gamma
    towards one rather than zero. ``fused`` runs it through ``megatron.core.fusions.fused_layer_norm``."""
    if zero_centered_gamma:
        weight = weight + 1
    if fused:
        return fused_norm(x, weight, bias, eps, normalization)
    shape = (x.shape[-1],)
    if normalization == "LayerNorm":
        return F.layer_norm(x, shape, weight, bias, eps)
    return F.rms_norm(x, shape, weight, eps)


class _ZeroCenteredGamma:
    """Mixin for torch's LayerNorm / RMSNorm: the weight holds gamma - 1 when ``zero_centered_gamma`` is set;
    ``fused`` (``persist_layer_norm``) routes the norm through the fused kernel."""

    _normalization = None

    def __init__(self, *args, zero_centered_gamma: bool = False, fused: bool = False, **kwargs):
        self.zero_centered_gamma = False  # what torch's __init__ (through reset_parameters) sees
        super().__init__(*args, **kwargs)
        self.zero_centered_gamma = zero_centered_gamma
        self.fused = fused
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.zero_centered_gamma and self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.zero_centered_gamma or self.fused):
            return super().forward(x)
        bias = getattr(self, "bias", None)
        return normalize(x, self._normalization, self.weight, bias, self.eps, self.zero_centered_gamma, self.fused)


class LayerNorm(_ZeroCenteredGamma, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` that can keep its gamma zero-centred."""

    _normalization = "LayerNorm"


class RMSNorm(_ZeroCenteredGamma, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` that can keep its gamma zero-centred."""

    _normalization = "RMSNorm"


class WrappedTorchNorm:
    """Builds a PyTorch LayerNorm or RMSNorm for ``config.normalization``, zero-centred with
    ``config.layernorm_zero_centered_gamma`` (which Megatron-Core's own PyTorch norms refuse; its Transformer
    Engine norms have it).

    With ``config.persist_layer_norm`` (Megatron-LM's default) the norm runs through the fused kernel layer
    (``megatron.core.fusions.fused_layer_norm``).

    Under sequence parallelism each rank normalises a different slice of the sequence, so the norm's parameter
    gradients are partial: the parameters are marked ``sequence_parallel=True`` for gradient finalisation to
    all-reduce them across the tensor-parallel group.
    """

    # The classes built; a subclass may build subclasses of them (e.g. with extra checkpoint state).
    _layer_norm_class = LayerNorm
    _rms_norm_class = RMSNorm

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = None,
    ):
        normalization = normalization or config.normalization
        if normalization == "LayerNorm":
            norm_class = cls._layer_norm_class
        elif normalization == "RMSNorm":
            norm_class = cls._rms_norm_class
        else:
            raise ValueError(f"normalization={normalization!r} is not supported; use 'LayerNorm' or 'RMSNorm'")
        zero_centered_gamma = zero_centered_gamma or config.layernorm_zero_centered_gamma
        norm = norm_class(
            hidden_size,
            eps=eps,
            dtype=config.params_dtype,
            zero_centered_gamma=zero_centered_gamma,
            fused=config.persist_layer_norm,
        )
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
