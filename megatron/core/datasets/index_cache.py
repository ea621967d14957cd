"""The on-disk cache of dataset indices: Megatron-LM's file names, atomic writes, memory-mapped reads.

Files are named `{md5 of the description}-{class}-{split}-{name}` in the cache directory. Global rank 0 writes them
(the builder makes the other ranks wait); every file is written to a temporary name and renamed into place, so a
crash can leave a missing file (a cache miss, rebuilt next time) but never a half-written one that is trusted.
"""

import logging
import os
import uuid
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

Arrays = Dict[str, np.ndarray]


class IndexCacheError(ValueError):
    """A cache file exists but cannot be read or does not fit the other cache files."""


def is_global_rank_0() -> bool:
    """True on global rank 0, and on every process before torch.distributed is initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def cache_file_paths(
    cache_dir: str, description_hash: str, class_name: str, split_name: str, array_names: Sequence[str]
) -> Dict[str, str]:
    """Paths of the description (key "description") and of each `{name}.npy` array, in Megatron-LM's naming."""
    base = os.path.join(cache_dir, f"{description_hash}-{class_name}-{split_name}")
    paths = {"description": f"{base}-description.txt"}
    paths.update({name: f"{base}-{name}.npy" for name in array_names})
    return paths


def load_or_build(
    paths: Optional[Dict[str, str]],
    description: str,
    build: Callable[[], Arrays],
    check: Callable[[Arrays, Dict[str, str]], None],
) -> Tuple[Arrays, bool]:
    """Read the cached arrays if all of `paths` exist, else build them (and, on global rank 0, cache them).

    `paths` None means no caching. `check(arrays, paths)` raises IndexCacheError when cached arrays do not fit
    together. Returns `(arrays, built_anew)`.
    """
    if paths is None:
        return build(), True
    if all(os.path.isfile(path) for path in paths.values()):
        arrays = {name: _load_array(path) for name, path in paths.items() if name != "description"}
        check(arrays, paths)
        return arrays, False
    arrays = build()
    if is_global_rank_0():
        _save_all(paths, description, arrays)
    else:
        logger.warning(
            "rank %d found no index cache at %s (is the cache directory shared with rank 0?); using indices built "
            "in memory, which are identical",
            torch.distributed.get_rank(),
            paths["description"],
        )
    return arrays, True


def _load_array(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise IndexCacheError(
            f"index cache file {path} is unreadable ({error}); delete it and rerun to rebuild the cache"
        ) from None


def _save_all(paths: Dict[str, str], description: str, arrays: Arrays) -> None:
    cache_dir = os.path.dirname(paths["description"])
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for name, array_ in arrays.items():
            _write_atomically(paths[name], lambda file, array_=array_: np.save(file, array_, allow_pickle=False))
        # The description goes last: its presence alone never marks a complete cache, but it helps a reader.
        _write_atomically(paths["description"], lambda file: file.write(description.encode("utf-8")))
    except OSError as error:
        raise OSError(
            f"cannot write the dataset index cache in {cache_dir} ({error}); point path_to_cache "
            f"(--data-cache-path) at a directory you can write to"
        ) from error


def _write_atomically(path: str, write: Callable) -> None:
    temporary = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
