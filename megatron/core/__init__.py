"""megatron.core: the library (parallel state, tensor/pipeline parallelism, transformer models, data, optimizers)."""

import importlib

from megatron.core.public_api import public_names as _public_names

# Megatron-Core's top-level names (``from megatron.core import ModelParallelConfig``), imported on first use so that
# importing any submodule stays cheap and cannot close an import cycle through the package root.
_MOVED = {
    "ModelParallelConfig": "megatron.core.model_parallel_config",
    "DistributedDataParallel": "megatron.core.distributed",
}


def __getattr__(name):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = _public_names(globals(), _MOVED)
