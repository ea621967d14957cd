"""A ``torch.distributed.checkpoint`` FileSystemReader that reads a checkpoint's ``.metadata`` once per directory.

Loading one checkpoint often builds several readers for the same directory (model and optimizer, or a resharding
tool that loads piece by piece); each would otherwise unpickle the same global metadata again. The cache is shared
by all instances and keyed by the directory's absolute path, so it must be cleared
(:meth:`CachedMetadataFileSystemReader.clear_metadata_cache`) when a directory is rewritten in place, as tests that
save and load the same path do.

The metadata is read through the project's allow-listed unpickler (``read_dcp_metadata``), not torch's plain
``pickle.load``, so a tampered ``.metadata`` file cannot run code.
"""

import os
from typing import Dict, Union

from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import StorageMeta

from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata


class CachedMetadataFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``read_metadata`` reads ``<path>/.metadata`` once per directory (``cache_metadata``).

    With ``cache_metadata=False`` it reads the file on every call, like a plain FileSystemReader.
    """

    _metadata_cache: Dict[str, Metadata] = {}

    def __init__(self, path: Union[str, os.PathLike], cache_metadata: bool = True) -> None:
        super().__init__(path=path)
        self._cache_key = os.path.abspath(os.fspath(path)) if cache_metadata else None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checkpoint's global metadata, from the shared cache when this directory was read before."""
        if self._cache_key is None:
            return self._read_metadata_file()
        cache = CachedMetadataFileSystemReader._metadata_cache
        if self._cache_key not in cache:
            cache[self._cache_key] = self._read_metadata_file()
        return cache[self._cache_key]

    def _read_metadata_file(self) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        # As torch's reader does: planners identify this load by the reader's load_id.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @classmethod
    def clear_metadata_cache(cls) -> None:
        """Forget every cached metadata (call after rewriting a checkpoint directory in place)."""
        cls._metadata_cache.clear()
