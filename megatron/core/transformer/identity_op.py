"""Identity stand-ins used by layer specs to switch a submodule off."""

import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input unchanged; accepts (and ignores) any constructor or call arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """Stands in for a function factory such as ``get_bias_dropout_add``: calling it returns the identity."""

    def forward(self, *args, **kwargs):
        return super().forward
