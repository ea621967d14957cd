"""Megatron-Core's switch for the Multi-Storage Client (object-store checkpoint paths such as ``msc://...``).

This project reads and writes checkpoints on local or mounted file systems only; the switch exists so that code
written for Megatron-Core (``MultiStorageClientFeature.disable()`` in tests and tools) runs unchanged. Enabling it
works only where the ``multistorageclient`` package is installed, and nothing here routes paths through it.
"""

import importlib.util
from typing import Any


class _FeatureFlag:
    """An on/off switch for an optional package: on only when enabled and the package is importable."""

    def __init__(self, package: str, install_hint: str, default: bool = False):
        self._package = package
        self._install_hint = install_hint
        self._enabled = default

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def _available(self) -> bool:
        return importlib.util.find_spec(self._package) is not None

    def is_enabled(self) -> bool:
        return self._enabled and self._available()

    def import_package(self) -> Any:
        """The package module; a RuntimeError saying what to do when it is missing or the switch is off."""
        if not self._available():
            raise RuntimeError(f"The {self._package} package is not available: {self._install_hint}")
        if not self._enabled:
            raise RuntimeError(f"The {self._package} feature is disabled: call MultiStorageClientFeature.enable()")
        return importlib.import_module(self._package)


MultiStorageClientFeature = _FeatureFlag("multistorageclient", "pip install multi-storage-client")
