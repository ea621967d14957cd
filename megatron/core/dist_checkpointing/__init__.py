"""Distributed checkpointing: every rank saves and loads only its pieces of the global state, in any parallel layout.

See ``mapping.py`` for how local state maps onto the global checkpoint.
"""

from .core import CheckpointingException, check_is_distributed_checkpoint
from .mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
