"""The serialization protocol shared by model configs and the config containers.

Megatron-LM 0.19's ``megatron.training.models`` also holds the model-config/builder classes (``ModelConfig``,
``GPTModelConfig``, ``HybridModelConfig`` and their builders); this project has only the protocol so far.
"""

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Serializable(Protocol):
    """An object that writes itself as a ``_target_`` dict (``as_dict``) and reads itself back (``from_dict``).
    ``ConfigContainerBase.to_dict`` uses ``as_dict`` for any value that has both methods."""

    def as_dict(self) -> dict[str, Any]:
        """This object as a dict whose ``_target_`` names its class."""
        ...

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Serializable":
        """The object ``data`` (as written by ``as_dict``) describes."""
        ...
