"""Strategy interfaces: how the sharded part of a checkpoint is stored (and a legacy common part read).

``save``/``load`` in ``serialization.py`` take a strategy object or a ``(backend, version)`` tuple; ``None`` means
the default for the backend, which :func:`get_default_strategy` looks up.
"""

import importlib
from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Tuple

from ..core import CheckpointingException
from ..mapping import CommonStateDict, ShardedStateDict, StateDict
from .async_utils import AsyncRequest


class StrategyAction(Enum):
    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


_DEFAULT_STRATEGIES: Dict[Tuple[StrategyAction, str, int], Any] = {}


def register_default_strategy(action: StrategyAction, backend: str, version: int, strategy) -> None:
    _DEFAULT_STRATEGIES[(action, backend, version)] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int):
    """The registered strategy doing ``action`` for ``backend`` at format ``version``."""
    for module in ("common", "torch"):  # importing the built-in backends registers them
        importlib.import_module(f"{__package__}.{module}")

    try:
        return _DEFAULT_STRATEGIES[(action, backend, version)]
    except KeyError:
        available = sorted({f"{b} v{v}" for (a, b, v) in _DEFAULT_STRATEGIES if a == action})
        raise CheckpointingException(
            f"no {action.value} strategy for backend {backend!r} version {version}; megatron-lite provides "
            f"{', '.join(available)}"
        ) from None


class _Strategy(ABC):
    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = version

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != self.backend:
            raise CheckpointingException(
                f"the checkpoint was written by backend {loaded_backend!r} but this strategy reads {self.backend!r}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != self.version:
            raise CheckpointingException(
                f"the checkpoint has {self.backend} format version {loaded_version} but this strategy reads "
                f"version {self.version}"
            )


class SaveShardedStrategy(_Strategy):
    """Writes the ShardedTensors and ShardedObjects of a (factory-free) sharded state dict."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        """Collective: write this rank's main replicas; the shards are complete on disk when it returns."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A save strategy that can return the write as an :class:`AsyncRequest`."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> AsyncRequest:
        """Collective up to staging: copy the data off the training buffers and return the pending write."""

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()


class LoadShardedStrategy(_Strategy):
    """Reads the pieces a sharded state dict asks for."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """Collective: the state dict with every ShardedTensor/ShardedObject replaced by its loaded value."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """``{key: data-less ShardedTensor covering the whole stored tensor}``."""

    @abstractmethod
    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """Like :meth:`load_tensors_metadata`, plus ``{unique_key: data-less ShardedObject}`` for stored objects."""


class LoadCommonStrategy(_Strategy):
    """Reads a legacy separately stored common state (``common.pt``); new checkpoints keep it in the shards."""

    @abstractmethod
    def load_common(self, checkpoint_dir: Path) -> CommonStateDict:
        """Read the non-sharded state."""
