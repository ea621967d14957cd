"""MegatronModule: the base class of every Megatron-Core model component."""

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` that carries its :class:`TransformerConfig`."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The state dict to put in a checkpoint (Megatron's hook; the plain state dict here)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def set_is_first_microbatch(self):
        """Tell every submodule that caches weights (FP8 / TE) that a new micro-batch sequence starts."""
        for module in self.modules():
            if hasattr(module, "is_first_microbatch"):
                module.is_first_microbatch = True
