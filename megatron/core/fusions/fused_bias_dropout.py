"""bias + dropout + residual add, the tail of every attention and MLP sublayer.

``get_bias_dropout_add(training, fused)`` returns ``f((x, bias), residual, prob) -> residual + dropout(x + bias)``.
The fused variant is a ``torch.jit``-style kernel on GPU in Megatron; here both variants run the same PyTorch ops
(``torch.compile`` can fuse them), so results are identical whichever is requested.
"""

from typing import Optional, Tuple

import torch


def _bias_dropout_add(x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]], residual, prob: float, training):
    x, bias = x_with_bias
    if bias is not None:
        x = x + bias
    out = torch.nn.functional.dropout(x, p=prob, training=training)
    return residual + out


def bias_dropout_add_unfused(training: bool):
    def _bias_dropout_add_func(x_with_bias, residual, prob):
        return _bias_dropout_add(x_with_bias, residual, prob, training)

    return _bias_dropout_add_func


def get_bias_dropout_add(training: bool, fused: bool):
    """The bias-dropout-add function for this mode (``fused`` selects the same math; see the module docstring)."""
    return bias_dropout_add_unfused(training)
