"""Megatron-Core's former home of the Mamba stack; the stack now lives in ``megatron.core.models.hybrid.hybrid_block``.

Names are looked up there on first use, so importing this module does not import the hybrid model package.
"""

_MOVED = ("MambaStack", "MambaStackSubmodules")


def __getattr__(name):
    if name in _MOVED:
        from megatron.core.models.hybrid import hybrid_block

        return getattr(hybrid_block, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
