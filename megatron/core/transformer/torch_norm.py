"""LayerNorm / RMSNorm from PyTorch, built the way Megatron-Core's specs ask for a norm."""

import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device


class WrappedTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` for ``config.normalization``.

    Under sequence parallelism each rank normalises a different slice of the sequence, so the norm's parameter
    gradients are partial: the parameters are marked ``sequence_parallel=True`` for gradient finalisation to
    all-reduce them across the tensor-parallel group.
    """

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
            raise ValueError(
                "layernorm_zero_centered_gamma is not supported by the PyTorch norms; set it to False"
            )
        normalization = normalization or config.normalization
        if normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization={normalization!r} is not supported; use 'LayerNorm' or 'RMSNorm'")
        norm.to(get_current_device())
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
