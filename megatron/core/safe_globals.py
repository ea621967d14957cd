"""The classes a checkpoint may hold outside plain tensors and containers, and loaders that refuse everything else.

Checkpoints are read with ``torch.load(..., weights_only=True)``: unpickling then builds only tensors, containers,
numbers, strings and the classes registered here (the training arguments' ``argparse.Namespace``, paths, NumPy's RNG
state, Megatron's enums and config dataclasses, ...). A pickle naming any other class or function -- which is how
a crafted file would run code on load -- is refused before anything of it runs. :class:`SafeUnpickler` applies the
same allow-list to plain pickles (e.g. DCP's ``.metadata``).

To read a trusted checkpoint that holds another harmless class, register it first:
``torch.serialization.add_safe_globals([MyClass])``.
"""

import argparse
import collections
import enum
import io
import pathlib
import pickle
import signal
import threading
import types
from typing import Any, Dict, List, Tuple
from unittest import mock

import numpy as np
import torch

from megatron.core import enums as core_enums
from megatron.core import rerun_state_machine
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer import enums as transformer_enums
from megatron.core.transformer.transformer_config import TransformerConfig


def _enums_of(module) -> List[type]:
    return [
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == module.__name__
    ]


def _numpy_globals() -> List[Tuple[Any, str]]:
    """(object, the name pickles refer to it by): NumPy arrays, scalars and dtypes, under NumPy 1 and 2 names."""
    multiarray = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
    entries = [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype")]
    for package in ("numpy._core", "numpy.core"):  # NumPy 2 pickles say numpy._core, NumPy 1 pickles numpy.core
        entries.append((multiarray._reconstruct, f"{package}.multiarray._reconstruct"))
        entries.append((multiarray.scalar, f"{package}.multiarray.scalar"))
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:  # NumPy >= 1.25 pickles dtypes by their class
        for name in dir(dtypes):
            cls = getattr(dtypes, name)
            if name.endswith("DType") and name != "ObjectDType" and isinstance(cls, type):
                entries.append((cls, f"numpy.dtypes.{name}"))
    return entries


def _allowed_globals() -> List[Tuple[Any, str]]:
    classes = [
        argparse.Namespace,
        types.SimpleNamespace,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
        signal.Signals,  # --exit-signal
        torch.Generator,
        io.BytesIO,  # a ShardedObject may hold serialized bytes (as Megatron's tests store)
        ModelParallelConfig,
        TransformerConfig,
        OptimizerConfig,
        DistributedDataParallelConfig,
        *_enums_of(core_enums),
        *_enums_of(transformer_enums),
        *_enums_of(rerun_state_machine),  # training checkpoints' rerun_state_machine entry
    ]
    named = [(cls, f"{cls.__module__}.{cls.__qualname__}") for cls in classes]
    return named + _numpy_globals()


def register_safe_globals() -> None:
    """Allow the classes above in ``torch.load(..., weights_only=True)`` (idempotent)."""
    torch.serialization.add_safe_globals(_allowed_globals())


def _dcp_metadata_globals() -> Dict[str, Any]:
    """What a DCP ``.metadata`` pickle names besides the allow-list: torch's checkpoint metadata records."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    records = [
        metadata.Metadata,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata.TensorProperties,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        # Megatron-Core 0.19 also stores every rank's save plan (Metadata.all_local_plans).
        planner.SavePlan,
        planner.WriteItem,
        planner.WriteItemType,
        planner.TensorWriteData,
        planner.BytesIOWriteData,
    ]
    found = {f"{r.__module__}.{r.__qualname__}": r for r in records}
    found["torch.Size"] = torch.Size
    found["torch.serialization._get_layout"] = torch.serialization._get_layout
    found["collections.OrderedDict"] = collections.OrderedDict
    return found


class SafeUnpickler(pickle.Unpickler):
    """A pickle reader that resolves only allow-listed globals (the list above, torch dtypes and DCP's metadata
    records); any other name raises ``pickle.UnpicklingError`` naming it, before it could be called."""

    def find_class(self, module: str, name: str):
        qualified = f"{module}.{name}"
        allowed = _ALLOWED_BY_NAME.get(qualified)
        if allowed is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = getattr(torch, name)
        if allowed is None:
            raise pickle.UnpicklingError(
                f"Refusing to unpickle disallowed class '{qualified}': GLOBAL {qualified} is not in "
                "megatron.core.safe_globals' allow-list"
            )
        return allowed


def safe_load_from_bytes(b):
    """Unpickle the bytes ``b`` with :class:`SafeUnpickler`."""
    return SafeUnpickler(io.BytesIO(b)).load()


def _safe_pickle_load(file, **kwargs):
    """``pickle.load`` through :class:`SafeUnpickler` (``kwargs`` as for ``pickle.Unpickler``)."""
    return SafeUnpickler(file, **kwargs).load()


# pickle.load is a process-wide name: one lock keeps concurrent safe_numpy_load calls from restoring it under another.
_pickle_patch_lock = threading.Lock()


def safe_numpy_load(path, **kwargs):
    """``numpy.load`` whose pickles (object arrays, with ``allow_pickle=True``) are read with :class:`SafeUnpickler`:
    allow-listed classes load, any other class raises ``pickle.UnpicklingError`` before it could run."""
    with _pickle_patch_lock, mock.patch("pickle.load", _safe_pickle_load):
        return np.load(path, **kwargs)


_ALLOWED_BY_NAME: Dict[str, Any] = {name: obj for obj, name in _allowed_globals()}
_ALLOWED_BY_NAME.update(_dcp_metadata_globals())
# As Megatron-Core does on import: plain torch.load(..., weights_only=True) accepts the allow-list from here on.
register_safe_globals()
