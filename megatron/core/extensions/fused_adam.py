"""Optional fused Adam kernels from Transformer Engine or apex, used on CUDA when installed.

Megatron-LM prefers Transformer Engine's FusedAdam, then apex's. Both take ``adam_w_mode`` to choose decoupled
(AdamW) weight decay. Without either, the optimizer falls back to torch's own fused Adam/AdamW, which is what runs on
CPU and on GPUs without these packages.
"""

import importlib
from typing import Optional

_CANDIDATES = (
    ("transformer_engine.pytorch.optimizers", "FusedAdam"),
    ("apex.optimizers", "FusedAdam"),
)


def find_fused_adam() -> Optional[type]:
    """The first installed FusedAdam class (Transformer Engine, then apex), or None."""
    for module_name, class_name in _CANDIDATES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        fused_adam = getattr(module, class_name, None)
        if fused_adam is not None:
            return fused_adam
    return None
