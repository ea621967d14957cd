"""Megatron-LM's indexed dataset: token sequences in a `.bin` file described by an `.idx` index.

The two files are byte-compatible with Megatron-LM's (MMIDIDX version 1), all little-endian:

- `{prefix}.bin`: every sequence's tokens back to back in the token dtype, no header.
- `{prefix}.idx`: a 34-byte header -- magic `MMIDIDX\\x00\\x00`, version u64 (= 1), token dtype code u8,
  sequence count S u64, document-index length D+1 u64 -- then int32[S] sequence lengths (tokens), int64[S] byte
  offsets of each sequence in `.bin`, int64[D+1] document indices (document i is sequences [di[i], di[i+1])),
  and, for multimodal datasets only, int8[S] sequence modes. Nothing follows.

Reading is O(1) per sequence: the index and (by default) the `.bin` are memory-mapped and `ds[i]` is a read-only
numpy view into the mapping. Every read is bounds-checked against the files' real sizes, so a damaged or mismatched
pair of files raises :class:`IndexedDatasetFormatError` naming the file instead of returning garbage.

This module needs only numpy, so tools such as `tools/preprocess_data.py` can use it without importing torch.
"""

import enum
import logging
import mmap
import os
import struct
import uuid
from array import array
from typing import Any, Optional, Tuple, Type, Union

import numpy as np

logger = logging.getLogger(__name__)

_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
# magic, version, token dtype code, sequence count, document-index length
_INDEX_HEADER = struct.Struct("<9sQBQQ")

DTypeLike = Union[Type[np.number], np.dtype, str]


class IndexedDatasetFormatError(ValueError):
    """A `.bin`/`.idx` pair that is not a valid Megatron indexed dataset (the message names the file)."""


class DType(enum.Enum):
    """Token dtypes of the `.idx` format, with their on-disk codes."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: DTypeLike) -> int:
        """The `.idx` code of a numpy dtype (`np.uint16` -> 8)."""
        try:
            return cls[np.dtype(value).name].value
        except (KeyError, TypeError):
            raise ValueError(
                f"token dtype {value!r} cannot be stored in an .idx file; use one of {[d.name for d in cls]}"
            ) from None

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[np.number]:
        """The numpy dtype (a scalar type such as `np.uint16`) of an `.idx` code."""
        try:
            return getattr(np, cls(value).name)
        except ValueError:
            known = ", ".join(f"{d.value} {d.name}" for d in cls)
            raise ValueError(f"unknown token dtype code {value!r} (known codes: {known})") from None

    @staticmethod
    def size(key: Union[int, DTypeLike]) -> int:
        """Bytes per token, given a dtype code or a numpy dtype."""
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            return np.dtype(DType.dtype_from_code(int(key))).itemsize
        DType.code_from_dtype(key)
        return np.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[np.number]:
        """The smallest token dtype for a vocabulary: uint16 below 65500 entries, else int32 (as Megatron-LM)."""
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def get_bin_path(path_prefix: str) -> str:
    """The `.bin` path of a dataset prefix."""
    return path_prefix + ".bin"


def get_idx_path(path_prefix: str) -> str:
    """The `.idx` path of a dataset prefix."""
    return path_prefix + ".idx"


def _file_size(path: str, what: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: indexed dataset {what} not found") from None


def _map_read_only(path: str, size: int):
    """A read-only buffer over a whole file (mmap cannot map an empty file, so that case is an empty bytes)."""
    if size == 0:
        return b""
    with open(path, "rb") as file:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


class _Index:
    """The parsed, validated `.idx` file; its arrays are read-only views into a memory mapping."""

    def __init__(self, idx_path: str, multimodal: bool):
        size = _file_size(idx_path, "index (.idx)")
        if size < _INDEX_HEADER.size:
            raise IndexedDatasetFormatError(
                f"{idx_path}: truncated index: {size} bytes, shorter than the {_INDEX_HEADER.size}-byte header"
            )
        with open(idx_path, "rb") as file:
            header = file.read(_INDEX_HEADER.size)
        magic, version, dtype_code, sequence_count, document_count = _INDEX_HEADER.unpack(header)
        if magic != _INDEX_MAGIC:
            raise IndexedDatasetFormatError(
                f"{idx_path}: not a Megatron indexed dataset index (magic {magic!r}, expected {_INDEX_MAGIC!r})"
            )
        if version != _INDEX_VERSION:
            raise IndexedDatasetFormatError(
                f"{idx_path}: index version {version} is not supported (only version {_INDEX_VERSION})"
            )
        try:
            self.dtype = DType.dtype_from_code(dtype_code)
        except ValueError as error:
            raise IndexedDatasetFormatError(f"{idx_path}: {error}") from None
        if document_count == 0:
            raise IndexedDatasetFormatError(
                f"{idx_path}: document index has 0 entries; it must hold at least the leading 0"
            )
        # Checked before mapping, so the frombuffer views below cannot run past the end of the file.
        self._check_size(idx_path, size, sequence_count, document_count, multimodal)

        self._buffer = _map_read_only(idx_path, size)
        offset = _INDEX_HEADER.size
        self.sequence_lengths = np.frombuffer(self._buffer, np.int32, sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(self._buffer, np.int64, sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(self._buffer, np.int64, document_count, offset)
        offset += self.document_indices.nbytes
        self.sequence_modes = np.frombuffer(self._buffer, np.int8, sequence_count, offset) if multimodal else None

        first, last = int(self.document_indices[0]), int(self.document_indices[-1])
        if first != 0 or last != sequence_count:
            raise IndexedDatasetFormatError(
                f"{idx_path}: inconsistent counts: document indices run from {first} to {last}, but they must "
                f"run from 0 to the sequence count {sequence_count}"
            )

    @staticmethod
    def _check_size(idx_path, size, sequence_count, document_count, multimodal):
        modes_bytes = sequence_count
        # 12 bytes per sequence: an int32 length and an int64 byte pointer; 8 per document-index entry.
        without_modes = _INDEX_HEADER.size + 12 * sequence_count + 8 * document_count
        expected = without_modes + (modes_bytes if multimodal else 0)
        if size == expected:
            return
        described = f"{sequence_count} sequences, {document_count - 1} documents"
        if multimodal and size == without_modes:
            raise IndexedDatasetFormatError(
                f"{idx_path}: index has no sequence modes; it is not multimodal, open it with multimodal=False"
            )
        if not multimodal and size == without_modes + modes_bytes:
            raise IndexedDatasetFormatError(
                f"{idx_path}: index ends with {modes_bytes} bytes of sequence modes; it is multimodal, "
                f"open it with multimodal=True"
            )
        if size < expected:
            raise IndexedDatasetFormatError(
                f"{idx_path}: truncated index: {size} bytes, but its header describes {expected} ({described})"
            )
        raise IndexedDatasetFormatError(
            f"{idx_path}: {size - expected} unexpected bytes after the last array (header describes {expected} "
            f"bytes: {described})"
        )


class _MmapBinReader:
    """Zero-copy reads: views into a memory mapping of the `.bin` file."""

    def __init__(self, bin_path: str, size: int):
        self._buffer = _map_read_only(bin_path, size)

    def read(self, dtype, count: int, byte_offset: int) -> np.ndarray:
        return np.frombuffer(self._buffer, dtype, count, byte_offset)


class _FileBinReader:
    """Reads that copy the bytes into a new array (`mmap=False`, e.g. for file systems where mmap is slow)."""

    def __init__(self, bin_path: str, size: int):
        self._bin_path = bin_path
        self._fd = os.open(bin_path, os.O_RDONLY)

    def read(self, dtype, count: int, byte_offset: int) -> np.ndarray:
        out = np.empty(count, dtype)
        # A positional read leaves the descriptor's offset alone, so concurrent reads cannot race on it.
        got = os.preadv(self._fd, [memoryview(out).cast("B")], byte_offset) if count else 0
        if got != out.nbytes:
            raise IndexedDatasetFormatError(
                f"{self._bin_path}: short read: {got} of {out.nbytes} bytes at offset {byte_offset}"
            )
        return out

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


class IndexedDataset:
    """Read a Megatron `.bin`/`.idx` dataset with O(1) random access to its sequences.

    Args:
        path_prefix: the path without the `.bin`/`.idx` suffix.
        multimodal: whether the index holds a mode per sequence (then reads also return the mode).
        mmap: memory-map the `.bin` (reads are zero-copy views); False reads each request into a new array.

        object_storage_config, s3_config: datasets in object storage (S3, MSC) -- not supported yet.
        fast_cache_load: Megatron's faster start-up path; accepted, no effect (the index is memory-mapped anyway).
        sequences_per_dataset, dtype_code: Megatron's way to skip reading the index header -- not supported yet.

    `ds[i]` and `ds.get(i, offset, length)` return a 1-D numpy array of tokens (multimodal: `(array, mode)`);
    `ds[a:b]` returns a list of arrays (multimodal: `(list, modes)`).
    """

    def __init__(
        self,
        path_prefix: str,
        multimodal: bool = False,
        mmap: bool = True,
        object_storage_config: Optional[Any] = None,
        s3_config: Optional[Any] = None,
        fast_cache_load: bool = False,
        sequences_per_dataset: Optional[Tuple[int, int]] = None,
        dtype_code: int = None,
    ) -> None:
        if s3_config is not None:
            raise ValueError(f"IndexedDataset {path_prefix}: not supported yet: S3 datasets (s3_config={s3_config!r})")
        self.initialize(
            path_prefix, multimodal, mmap, object_storage_config, fast_cache_load, sequences_per_dataset, dtype_code
        )

    def initialize(
        self,
        path_prefix: str,
        multimodal: bool,
        mmap: bool,
        object_storage_config: Optional[Any],
        fast_cache_load: bool = False,
        sequences_per_dataset: Optional[Tuple[int, int]] = None,
        dtype_code: int = None,
    ) -> None:
        """Open the `.idx`/`.bin` pair of `path_prefix` (what the constructor and unpickling call)."""
        unsupported = {
            "datasets in object storage": ("object_storage_config", object_storage_config),
            "a known sequence count instead of the index header": ("sequences_per_dataset", sequences_per_dataset),
            "a known dtype instead of the index header": ("dtype_code", dtype_code),
        }
        for feature, (name, value) in unsupported.items():
            if value is not None:
                raise ValueError(f"IndexedDataset {path_prefix}: not supported yet: {feature} ({name}={value!r})")
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.fast_cache_load = fast_cache_load
        self._document_indices_override = None
        self._idx_path = get_idx_path(path_prefix)
        self._bin_path = get_bin_path(path_prefix)
        self._index = _Index(self._idx_path, multimodal)
        self._itemsize = np.dtype(self._index.dtype).itemsize
        self._bin_size = _file_size(self._bin_path, "data (.bin)")
        self._check_bin_covers_index()
        reader_class = _MmapBinReader if mmap else _FileBinReader
        self._bin_reader = reader_class(self._bin_path, self._bin_size)

    def _check_bin_covers_index(self):
        if len(self) == 0:
            return
        # Sequences are stored in order, so the last one ends furthest into the file.
        end = int(self._index.sequence_pointers[-1]) + int(self._index.sequence_lengths[-1]) * self._itemsize
        if self._bin_size < end:
            raise IndexedDatasetFormatError(
                f"{self._bin_path}: data file has {self._bin_size} bytes but {self._idx_path} describes {end}; "
                f"the .bin is truncated or belongs to another index"
            )
        if self._bin_size > end:
            logger.warning(
                "%s: %d bytes after the last sequence that %s describes; they are ignored",
                self._bin_path,
                self._bin_size - end,
                self._idx_path,
            )

    def __getstate__(self):
        # A memory mapping cannot be pickled (e.g. to dataloader workers); the receiver reopens the files.
        return (self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state):
        self.initialize(*state, None)

    def __len__(self) -> int:
        return len(self._index.sequence_lengths)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of an IndexedDataset must be contiguous (step 1), got step {step}")
            sequences = [self._read(i, 0, None) for i in range(start, stop)]
            if self.multimodal:
                return sequences, self._index.sequence_modes[start:stop]
            return sequences
        raise TypeError(f"IndexedDataset indices must be integers or slices, not {type(idx).__name__}")

    def get(
        self, idx: int, offset: int = 0, length: Optional[int] = None
    ) -> Union[np.ndarray, Tuple[np.ndarray, np.number]]:
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end when `length` is None)."""
        sequence = self._read(idx, offset, length)
        if self.multimodal:
            return sequence, int(self._index.sequence_modes[idx])
        return sequence

    def _read(self, idx: int, offset: int, length: Optional[int]) -> np.ndarray:
        count = len(self)
        if not -count <= idx < count:
            raise IndexError(f"sequence index {idx} out of range for {self.path_prefix} ({count} sequences)")
        sequence_length = int(self._index.sequence_lengths[idx])
        pointer = int(self._index.sequence_pointers[idx])
        if sequence_length < 0:
            raise IndexedDatasetFormatError(f"{self._idx_path}: sequence {idx} has a negative length {sequence_length}")
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) are outside sequence {idx} of {self.path_prefix}, "
                f"which has {sequence_length} tokens"
            )
        start = pointer + offset * self._itemsize
        if pointer < 0 or start + length * self._itemsize > self._bin_size:
            raise IndexedDatasetFormatError(
                f"{self._idx_path}: sequence {idx} (byte offset {pointer}, {sequence_length} tokens) lies outside "
                f"{self._bin_path} ({self._bin_size} bytes)"
            )
        return self._bin_reader.read(self._index.dtype, length, start)

    @property
    def dtype(self) -> Type[np.number]:
        """The token dtype (a numpy scalar type such as `np.uint16`)."""
        return self._index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32[S]: tokens per sequence."""
        return self._index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64[S]: byte offset of each sequence in the `.bin` file."""
        return self._index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64[D+1]: document i is sequences `[document_indices[i], document_indices[i+1])` (the index's, or
        those given to :meth:`set_document_indices`)."""
        if self._document_indices_override is not None:
            return self._document_indices_override
        return self._index.document_indices

    def get_document_indices(self) -> np.ndarray:
        """The document indices (see :attr:`document_indices`)."""
        return self.document_indices

    def set_document_indices(self, document_indices: np.ndarray) -> None:
        """Regroup the sequences into other documents (e.g. one document per sequence), for everything built on
        this dataset from now on; the files are not changed. The boundaries must start at 0, never decrease and end
        at the number of sequences."""
        indices = np.asarray(document_indices)
        if indices.ndim != 1 or indices.size == 0 or not np.issubdtype(indices.dtype, np.integer):
            raise ValueError(f"{self.path_prefix}: document indices must be a non-empty 1-D integer array")
        if indices[0] != 0 or indices[-1] != len(self) or np.any(np.diff(indices) < 0):
            raise ValueError(
                f"{self.path_prefix}: document indices must start at 0, never decrease and end at the {len(self)} "
                f"sequences, got {indices[:4].tolist()}...{indices[-2:].tolist()}"
            )
        self._document_indices_override = indices.astype(np.int64)

    @property
    def sequence_modes(self) -> Optional[np.ndarray]:
        """int8[S]: the mode of each sequence, or None when the dataset is not multimodal."""
        return self._index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both `{path_prefix}.idx` and `{path_prefix}.bin` exist."""
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Write a Megatron `.bin`/`.idx` dataset.

    Tokens stream to a temporary file beside `bin_path`; only `finalize(idx_path)` puts the `.bin` and the `.idx`
    at their final paths (by rename, the `.idx` last), so a crash part-way never leaves a valid-looking but wrong
    pair of files. The index (4 bytes per sequence, 8 per document) is kept in memory until then.

    Args:
        bin_path: where the `.bin` file goes.
        dtype: the token dtype; `DType.optimal_dtype(vocab_size)` picks the smallest that fits a vocabulary.
        multimodal: store a mode (int8) per sequence.
    """

    def __init__(self, bin_path: str, dtype: Type[np.number] = np.int32, multimodal: bool = False) -> None:
        DType.code_from_dtype(dtype)
        self.dtype = np.dtype(dtype).type
        self.multimodal = multimodal
        self.bin_path = bin_path
        # A random suffix, opened with "xb": two builders aiming at one path never share a partial file.
        self._partial_bin_path = f"{bin_path}.partial-{uuid.uuid4().hex[:8]}"
        self._data_file = open(self._partial_bin_path, "xb")
        self._sequence_lengths = array("i")
        self._document_indices = array("q", [0])
        self._sequence_modes = array("b") if multimodal else None

    def add_item(self, tensor, mode: int = 0) -> None:
        """Append one sequence (any 1-D array-like of token ids, a CPU torch tensor included)."""
        tokens = self._as_tokens(tensor)
        self._append_lengths([tokens.size])
        if self.multimodal:
            self._sequence_modes.append(mode)
        self._data_file.write(tokens.tobytes())

    def add_document(self, tensor, lengths, modes=None) -> None:
        """Append one document: the tokens of all its sequences, the sequence lengths, and (multimodal) modes."""
        tokens = self._as_tokens(tensor)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if np.any(lengths < 0) or int(lengths.sum()) != tokens.size:
            raise ValueError(
                f"add_document: sequence lengths {lengths.tolist()[:8]} (sum {int(lengths.sum())}) must be "
                f"non-negative and add up to the {tokens.size} tokens given"
            )
        if self.multimodal:
            modes = np.zeros(len(lengths), np.int8) if modes is None else np.asarray(modes, np.int8).reshape(-1)
            if len(modes) != len(lengths):
                raise ValueError(f"add_document: {len(modes)} modes given for {len(lengths)} sequences")
        elif modes is not None:
            raise ValueError("add_document: modes given, but the builder is not multimodal (pass multimodal=True)")
        self._append_lengths(lengths)
        if self.multimodal:
            self._sequence_modes.frombytes(modes.tobytes())
        self._data_file.write(tokens.tobytes())
        self.end_document()

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last boundary form one document."""
        self._document_indices.append(len(self._sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (its documents and tokens) to this one."""
        dataset = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if np.dtype(dataset.dtype) != np.dtype(self.dtype):
            raise ValueError(
                f"add_index: {get_idx_path(path_prefix)} holds {np.dtype(dataset.dtype).name} tokens but this "
                f"builder writes {np.dtype(self.dtype).name}; build with dtype={np.dtype(dataset.dtype).name}"
            )
        data_bytes = _contiguous_data_bytes(dataset)
        offset = len(self._sequence_lengths)
        self._append_lengths(dataset.sequence_lengths)
        # Skip the appended dataset's leading 0 and shift its boundaries past the sequences already here.
        self._document_indices.frombytes((dataset.document_indices[1:] + offset).astype(np.int64).tobytes())
        if self.multimodal:
            self._sequence_modes.frombytes(dataset.sequence_modes.tobytes())
        with open(get_bin_path(path_prefix), "rb") as source:
            _copy_bytes(source, self._data_file, data_bytes)

    def finalize(self, idx_path: str) -> None:
        """Write the index and move both files to their final paths."""
        if self._data_file.closed:
            raise ValueError(f"finalize: the builder of {self.bin_path} was already finalized or aborted")
        unclosed = len(self._sequence_lengths) - self._document_indices[-1]
        if unclosed:
            raise ValueError(
                f"finalize: {unclosed} sequences were added after the last document boundary; call "
                f"end_document() before finalize()"
            )
        self._data_file.flush()
        # Durable before the rename: the final .bin must never name data still only in the page cache.
        os.fsync(self._data_file.fileno())
        self._data_file.close()
        partial_idx_path = f"{idx_path}.partial-{uuid.uuid4().hex[:8]}"
        try:
            self._write_index(partial_idx_path)
            # Remove a previous .idx first: between the two renames the new .bin must never pair with an old .idx.
            if os.path.lexists(idx_path):
                os.remove(idx_path)
            os.replace(self._partial_bin_path, self.bin_path)
            os.replace(partial_idx_path, idx_path)
        except BaseException:
            for path in (partial_idx_path, self._partial_bin_path):
                if os.path.exists(path):
                    os.remove(path)
            raise

    def abort(self) -> None:
        """Give up: close and delete the partial `.bin`; nothing is written at the final paths."""
        self._data_file.close()
        if os.path.exists(self._partial_bin_path):
            os.remove(self._partial_bin_path)

    def _as_tokens(self, tensor) -> np.ndarray:
        values = np.asarray(tensor).reshape(-1)
        target = np.dtype(self.dtype)
        if values.size and not np.can_cast(values.dtype, target, casting="safe"):
            # Narrowing integers (e.g. int64 ids to uint16) is fine when every id fits: check the values, not the dtype.
            if target.kind in "iu" and values.dtype.kind in "iub":
                low, high = np.iinfo(target).min, np.iinfo(target).max
                if values.min() < low or values.max() > high:
                    raise ValueError(
                        f"token ids outside [{low}, {high}] cannot be stored as {target.name} in {self.bin_path}; "
                        f"use a wider dtype (DType.optimal_dtype(vocab_size))"
                    )
            elif target.kind in "iu":
                raise ValueError(f"tokens of dtype {values.dtype.name} cannot be stored as {target.name}")
        return values.astype(target, copy=False)

    def _append_lengths(self, lengths) -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {int(lengths.max())} tokens exceeds the .idx limit of 2**31 - 1")
        self._sequence_lengths.frombytes(lengths.astype(np.int32).tobytes())

    def _write_index(self, path: str) -> None:
        lengths = np.frombuffer(self._sequence_lengths, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths) > 1:
            # In int64: byte offsets of a large .bin overflow int32.
            np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(self.dtype).itemsize, out=pointers[1:])
        header = _INDEX_HEADER.pack(
            _INDEX_MAGIC, _INDEX_VERSION, DType.code_from_dtype(self.dtype), len(lengths), len(self._document_indices)
        )
        with open(path, "xb") as index_file:
            index_file.write(header)
            index_file.write(lengths.tobytes())
            index_file.write(pointers.tobytes())
            index_file.write(self._document_indices.tobytes())
            if self.multimodal:
                index_file.write(self._sequence_modes.tobytes())
            index_file.flush()
            os.fsync(index_file.fileno())


def _contiguous_data_bytes(dataset: IndexedDataset) -> int:
    """Bytes of token data in `dataset`, after checking its sequences lie back to back from offset 0 (as
    Megatron-LM writes them), which is what lets `add_index` copy the `.bin` as one block."""
    itemsize = np.dtype(dataset.dtype).itemsize
    sizes = dataset.sequence_lengths.astype(np.int64) * itemsize
    expected_pointers = np.concatenate(([0], np.cumsum(sizes[:-1]))) if len(sizes) else sizes
    if not np.array_equal(dataset.sequence_pointers, expected_pointers):
        raise IndexedDatasetFormatError(
            f"{get_idx_path(dataset.path_prefix)}: sequences are not stored back to back from offset 0, so the "
            f"dataset cannot be merged with add_index"
        )
    return int(sizes.sum())


def _copy_bytes(source, destination, count: int, chunk_size: int = 16 * 1024 * 1024) -> None:
    while count > 0:
        chunk = source.read(min(chunk_size, count))
        if not chunk:
            raise IndexedDatasetFormatError(f"{source.name}: ended {count} bytes before the data its index describes")
        destination.write(chunk)
        count -= len(chunk)
