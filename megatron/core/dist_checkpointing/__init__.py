"""Distributed checkpointing: every rank saves and loads only its pieces of the global state, in any parallel layout.

``mapping.py`` says how local state maps onto the global checkpoint; ``serialization.py`` saves and loads it in
Megatron-Core 0.19's ``torch_dist`` format (PyTorch DCP files holding the shards and the ``common_state`` object,
``metadata.json``; a legacy ``common.pt`` is read when present).
"""

from .core import CheckpointingException, check_is_distributed_checkpoint
from .mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
from .serialization import (
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from .validation import StrictHandling

__all__ = [
    "CheckpointingException",
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StrictHandling",
    "check_is_distributed_checkpoint",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "save",
]
