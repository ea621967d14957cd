"""Checksums for checkpoint files: computed while the bytes are written, verified while they are read.

Every file a save writes (``.distcp`` shards, ``.metadata``, ``metadata.json``, a legacy ``model_optim_rng.pt`` or
``distrib_optim.pt``) passes through a :class:`ChecksumStream`, which checksums the bytes on their way to the file;
no second pass over the data. The checksums land in a small JSON record per file, ``checksums/<file>.json`` in the
checkpoint directory (this project's files: Megatron-Core reads only the files it names, so it ignores them). A
record is written before the file it describes is marked complete, so a complete checkpoint has every record.

A file is checksummed in segments: a large write (a tensor's bytes, split every ``MAX_SEGMENT`` bytes) is a segment
of its own, runs of small writes (headers, pickles) are grouped up to ``RUN_BYTES``. Reading goes through a
:class:`VerifiedStream`: a large segment read from its start in order is checksummed in the caller's buffer as it
arrives (``torch.load`` reads a tensor's bytes in one call, so no copy is added), and what was read of it out of
order is checked when the file is done; a small segment is loaded whole, checked and served from memory. A
mismatch raises :class:`ChecksumMismatchError` naming the file and the byte range, before the load returns.

A checkpoint without a ``checksums/`` directory (written by Megatron, or by an earlier version of this project)
loads unverified, with one notice per checkpoint on rank 0. :func:`verification` switches checking off
(``--no-ckpt-verify``).
"""

import bisect
import contextlib
import dataclasses
import io
import json
import logging
import os
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

from torch.distributed.checkpoint.filesystem import FileSystem

from .core import CONFIG_FNAME, CheckpointingConfig, CheckpointingException, parse_config

try:  # hardware CRC-32C, ~10 GB/s; zlib's CRC-32 (~1.5 GB/s here) when the package is missing
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - exercised only where crc32c is not installed
    _crc32c = None

logger = logging.getLogger(__name__)

CHECKSUMS_DIRNAME = "checksums"
RECORD_FORMAT = "megatron-lite checkpoint checksums"
RECORD_VERSION = 1
BIG_WRITE = 256 * 1024  # a write at least this long is a segment of its own (tensor data)
RUN_BYTES = 1 << 20  # small writes are grouped into segments of about this size
MAX_SEGMENT = 64 << 20  # large writes are split: a mismatch is located within this many bytes
_PIECE = 1 << 20  # large reads and writes are checksummed in pieces this size, while they are in the CPU cache
_CACHE_BYTES = 128 << 20  # segments a reader keeps in memory after checking them
_ADVICE = (
    "restore the file from a copy, load an earlier checkpoint (--ckpt-step <iteration>), or pass --no-ckpt-verify "
    "to skip the checksums at your own risk"
)

PathLike = Union[str, os.PathLike]


def _checksum_function(algorithm: str) -> Callable[[object, int], int]:
    if algorithm == "crc32c":
        if _crc32c is None:
            raise CheckpointingException(
                "this checkpoint's checksums are CRC-32C, which needs the crc32c package: pip install crc32c (or "
                "pass --no-ckpt-verify to load without verifying)"
            )
        return _crc32c.crc32c
    if algorithm == "crc32":
        return zlib.crc32
    raise CheckpointingException(f"unknown checksum algorithm {algorithm!r} (this project writes crc32c or crc32)")


DEFAULT_ALGORITHM = "crc32c" if _crc32c is not None else "crc32"


class ChecksumMismatchError(CheckpointingException):
    """A checkpoint file's bytes differ from the checksums recorded when it was saved."""


# ---- the switch ---------------------------------------------------------------------------------------------------

_state = threading.local()
_noticed: set = set()


def verification_enabled() -> bool:
    return getattr(_state, "enabled", True)


@contextlib.contextmanager
def verification(enabled: bool) -> Iterator[None]:
    """Within the block, reads of checkpoint files are verified against their checksums (``enabled``) or not."""
    previous = verification_enabled()
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


# ---- records ------------------------------------------------------------------------------------------------------


@dataclass
class FileRecord:
    """The checksums of one file: (offset, length, checksum) segments covering it in order."""

    size: int
    algorithm: str
    segments: List[Tuple[int, int, int]]


def _body(relative: str, record: FileRecord) -> dict:
    return {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "file": relative,
        "size": record.size,
        "algorithm": record.algorithm,
        "segments": [list(segment) for segment in record.segments],
    }


def _self_checksum(body: dict) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def record_path(root: PathLike, relative: str) -> Path:
    return Path(root) / CHECKSUMS_DIRNAME / f"{relative}.json"


def write_record(root: PathLike, relative: str, record: FileRecord) -> None:
    """Write (durably) the record of ``<root>/<relative>``; call it before marking that file complete."""
    path = record_path(root, relative)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = _body(relative, record)
    body["record_crc32"] = _self_checksum(body)
    temporary = path.with_name(f"{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    with open(temporary, "w") as file:
        json.dump(body, file, separators=(",", ":"))
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def remove_records(root: PathLike) -> None:
    """Drop the records of an earlier save into ``root`` (before a new save writes there)."""
    directory = Path(root) / CHECKSUMS_DIRNAME
    if directory.is_dir():
        for path in sorted(directory.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        directory.rmdir()


def _read_record(root: Path, relative: str) -> FileRecord:
    path = record_path(root, relative)
    damaged = f"the checksum record {path} (of {root / relative}) is damaged"
    try:
        body = json.loads(path.read_bytes())
        stored = body.pop("record_crc32")
        if stored != _self_checksum(body) or body.get("format") != RECORD_FORMAT or body.get("file") != relative:
            raise ValueError("its own checksum does not match")
        record = FileRecord(body["size"], body["algorithm"], [tuple(s) for s in body["segments"]])
    except FileNotFoundError:
        raise ChecksumMismatchError(
            f"{root / relative} has no checksum record ({path} is missing) although the checkpoint {root} has "
            f"checksums: the checkpoint was altered after it was saved; {_ADVICE}"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ChecksumMismatchError(f"{damaged} ({error}); {_ADVICE}") from None
    if body.get("version") != RECORD_VERSION:
        raise CheckpointingException(f"{path} has record version {body.get('version')}; this reader knows 1")
    return record


def record_for(path: PathLike, root: PathLike) -> Optional[FileRecord]:
    """The record to verify ``path`` (a file under the checkpoint directory ``root``) with, or None when it is not
    verified: verification is off, or the checkpoint has no checksums (one notice per checkpoint, on rank 0)."""
    if not verification_enabled():
        return None
    root = Path(root)
    if not has_checksums(root):
        _notice_unverifiable(root)
        return None
    return _read_record(root, _relative(path, root))


def _notice_unverifiable(root: Path) -> None:
    from .exchange import get_rank

    key = str(root.resolve())
    if key in _noticed:
        return
    _noticed.add(key)
    if get_rank() == 0:
        logger.warning(
            "checkpoint %s has no checksums (written by Megatron or an earlier megatron-lite): loading it unverified",
            root,
        )


def legacy_root(path: PathLike) -> Path:
    """The checkpoint directory of a file: ``iter_N`` for ``iter_N/mp_rank_*/<file>``, else the file's directory."""
    parent = Path(path).parent
    return parent.parent if parent.name.startswith("mp_rank_") else parent


# ---- writing ------------------------------------------------------------------------------------------------------


class ChecksumStream(io.RawIOBase):
    """A write-only stream that checksums the bytes it passes to ``raw`` (see the module docstring)."""

    def __init__(self, raw, algorithm: str = DEFAULT_ALGORITHM):
        super().__init__()
        self.raw = raw
        self.algorithm = algorithm
        self._checksum = _checksum_function(algorithm)
        self._segments: List[Tuple[int, int, int]] = []
        self._position = 0
        self._run_start, self._run_crc = 0, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        length = len(view)
        if length >= BIG_WRITE:
            self._close_run()
            for start in range(0, length, MAX_SEGMENT):
                piece = view[start : start + MAX_SEGMENT]
                crc = 0
                for offset in range(0, len(piece), _PIECE):
                    # Checksummed then written piece by piece: the write copies bytes still in the CPU cache.
                    crc = self._checksum(piece[offset : offset + _PIECE], crc)
                    self._write_all(piece[offset : offset + _PIECE])
                self._segments.append((self._position + start, len(piece), crc))
            self._run_start = self._position + length
        elif length:
            self._run_crc = self._checksum(view, self._run_crc)
            self._write_all(view)
        self._position += length
        if self._position - self._run_start >= RUN_BYTES:
            self._close_run()
        return length

    def _write_all(self, view: memoryview) -> None:
        written = 0
        while written < len(view):  # a raw (unbuffered) file may take part of it
            written += self.raw.write(view[written:]) or 0

    def _close_run(self) -> None:
        if self._position > self._run_start:
            self._segments.append((self._run_start, self._position - self._run_start, self._run_crc))
        self._run_start, self._run_crc = self._position, 0

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self.raw.flush()
        super().close()

    def record(self) -> FileRecord:
        self._close_run()
        return FileRecord(self._position, self.algorithm, list(self._segments))


def record_of_bytes(data: bytes) -> FileRecord:
    """The record of a file whose whole content is ``data`` (checksummed in memory, before it is written)."""
    stream = ChecksumStream(io.BytesIO())
    stream.write(data)
    return stream.record()


def has_checksums(root: PathLike) -> bool:
    return (Path(root) / CHECKSUMS_DIRNAME).is_dir()


def _relative(path: PathLike, root: PathLike) -> str:
    return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()


def write_small_file(path: PathLike, root: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` (write-then-rename, fsynced), after its checksum record when the checkpoint in
    ``root`` has checksums (a record alone among unrecorded files would make the others fail to verify)."""
    path = Path(path)
    if has_checksums(root):
        write_record(root, _relative(path, root), record_of_bytes(data))
    temporary = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


_capture = threading.local()


@contextlib.contextmanager
def capture_records() -> Iterator[Dict[str, FileRecord]]:
    """Collects ``{path: record}`` of the files :func:`torch_save` writes within the block (the caller writes the
    records under the files' final names before renaming them into place)."""
    captured: Dict[str, FileRecord] = {}
    previous = getattr(_capture, "records", None)
    _capture.records = captured
    try:
        yield captured
    finally:
        _capture.records = previous


def torch_save(obj, path: PathLike) -> None:
    """``torch.save(obj, path)``, checksummed on the way (recorded when inside :func:`capture_records`)."""
    import torch

    with open(path, "wb") as raw:
        stream = ChecksumStream(raw)
        torch.save(obj, stream)
        stream.flush()
        os.fsync(raw.fileno())
    records = getattr(_capture, "records", None)
    if records is not None:
        records[os.fspath(path)] = stream.record()


# ---- reading ------------------------------------------------------------------------------------------------------


_checksummer: Optional[ThreadPoolExecutor] = None


def _background() -> ThreadPoolExecutor:
    global _checksummer
    if _checksummer is None:
        _checksummer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-checksum")
    return _checksummer


def _fold_while_reading(checksum, crc: int, target: memoryview, read_piece) -> int:
    """Read ``target`` piece by piece with ``read_piece(offset, chunk)`` and return ``crc`` folded over it.

    Each piece is checksummed on a background thread while the next one is read (both release the GIL), so on a
    machine with a spare core the checksum hides behind the read instead of adding to it; one thread keeps the
    pieces in order. Pieces are checksummed right after their read, while still in the CPU cache."""
    state = [crc]

    def fold(chunk: memoryview) -> None:
        state[0] = checksum(chunk, state[0])

    pending = []
    for piece in range(0, len(target), _PIECE):
        chunk = target[piece : piece + _PIECE]
        read_piece(piece, chunk)
        pending.append(_background().submit(fold, chunk))
    for future in pending:
        future.result()
    return state[0]


class VerifiedStream(io.RawIOBase):
    """A seekable read-only view of ``raw`` that checks every byte it returns against ``record``."""

    def __init__(self, raw, record: FileRecord, path: PathLike):
        super().__init__()
        self.raw, self.record, self.path = raw, record, str(path)
        self._checksum = _checksum_function(record.algorithm)
        self._starts = [segment[0] for segment in record.segments]
        self._position = 0
        self._cache: "OrderedDict[int, bytes]" = OrderedDict()
        self._cached_bytes = 0
        self._streaming: Dict[int, Tuple[int, int]] = {}  # segment -> (next offset, checksum so far)
        self._verified: set = set()
        actual = os.fstat(raw.fileno()).st_size
        if actual != record.size:
            raise ChecksumMismatchError(
                f"checkpoint file {self.path} is {actual} bytes, but {record.size} were written when it was saved "
                f"(truncated or overwritten); {_ADVICE}"
            )

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self.record.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def fileno(self) -> int:
        return self.raw.fileno()

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self.record.size - self._position))
        done = 0
        while done < wanted:
            index = bisect.bisect_right(self._starts, self._position) - 1
            start, length, _ = self.record.segments[index]
            take = min(wanted - done, start + length - self._position)
            target = view[done : done + take]
            if index in self._cache:
                offset = self._position - start
                target[:] = self._cache[index][offset : offset + take]
            elif length >= BIG_WRITE:
                self._read_large(index, target)
            else:
                segment = self._load_segment(index)
                target[:] = memoryview(segment)[self._position - start : self._position - start + take]
            self._position += take
            done += take
        return done

    def read(self, size: int = -1) -> bytes:
        remaining = max(0, self.record.size - self._position)
        buffer = bytearray(remaining if size is None or size < 0 else min(size, remaining))
        return bytes(buffer[: self.readinto(buffer)])

    def _read_large(self, index: int, target: memoryview) -> None:
        """Read straight into the caller's buffer; the bytes are checksummed as they arrive when the segment is read
        in order from its start (torch reads a tensor's bytes in one call). Other reads (torch scanning the end of a
        file) leave the segment to :meth:`finish`, so every byte is checked before the load returns."""
        start, length, _ = self.record.segments[index]
        offset, crc = self._streaming.get(index, (start, 0))
        if index in self._verified or self._position != offset:
            self._read_exactly(self._position, target)
            if index not in self._verified:
                self._streaming[index] = (offset, crc)
            return
        crc = _fold_while_reading(
            self._checksum, crc, target, lambda piece, chunk: self._read_exactly(self._position + piece, chunk)
        )
        end = offset + len(target)
        if end < start + length:
            self._streaming[index] = (end, crc)
            return
        self._streaming.pop(index, None)
        self._check(index, crc)
        self._verified.add(index)

    def _load_segment(self, index: int) -> bytes:
        start, length, _ = self.record.segments[index]
        data = bytearray(length)
        self._read_exactly(start, memoryview(data))
        self._check(index, self._checksum(data, 0))
        self._streaming.pop(index, None)
        data = bytes(data)
        self._cache[index] = data
        self._cached_bytes += length
        while self._cached_bytes > _CACHE_BYTES and len(self._cache) > 1:
            self._cached_bytes -= len(self._cache.popitem(last=False)[1])
        return data

    def _read_exactly(self, offset: int, target: memoryview) -> None:
        self.raw.seek(offset)
        got = 0
        while got < len(target):
            count = self.raw.readinto(target[got:])
            if not count:
                raise ChecksumMismatchError(f"checkpoint file {self.path} ended early at byte {offset + got}")
            got += count

    def _check(self, index: int, crc: int) -> None:
        start, length, expected = self.record.segments[index]
        if crc != expected:
            raise ChecksumMismatchError(
                f"checkpoint file {self.path} is corrupt: bytes {start}-{start + length - 1} (of {self.record.size}) "
                f"do not match the checksum recorded when it was saved; the load was stopped before any of it was "
                f"used. To go on: {_ADVICE}"
            )

    def finish(self) -> None:
        """Check the rest of every segment that was read only in part (called when the reader is done)."""
        for index, (offset, crc) in list(self._streaming.items()):
            start, length, _ = self.record.segments[index]
            rest = bytearray(start + length - offset)
            self._read_exactly(offset, memoryview(rest))
            self._streaming.pop(index)
            self._check(index, self._checksum(rest, crc))


@contextlib.contextmanager
def open_verified(path: PathLike, root: PathLike) -> Iterator[io.RawIOBase]:
    """``open(path, "rb")``, verified against the checksums of the checkpoint in ``root`` when it has them."""
    record = record_for(path, root)
    with open(path, "rb") as raw:
        if record is None:
            yield raw
            return
        stream = VerifiedStream(raw, record, path)
        yield stream
        stream.finish()


def read_verified_bytes(path: PathLike, root: PathLike) -> bytes:
    """The whole content of a (small) checkpoint file, verified."""
    with open_verified(path, root) as file:
        return file.read()


# ---- PyTorch DCP files ----------------------------------------------------------------------------------------------


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, writing every file through a :class:`ChecksumStream` and its record beside it: at
    once for data files, at the rename for a ``*.tmp`` file (DCP renames ``.metadata.tmp`` into place, which
    completes the checkpoint, so the record must exist first)."""

    def __init__(self, root: PathLike):
        super().__init__()
        self.root = Path(root)
        self._pending: Dict[str, FileRecord] = {}

    @contextlib.contextmanager
    def create_stream(self, path: PathLike, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode) as raw:
            stream = ChecksumStream(raw)
            yield stream
            record = stream.record()
        if os.fspath(path).endswith(".tmp"):
            self._pending[os.fspath(path)] = record
        else:
            write_record(self.root, _relative(path, self.root), record)

    def rename(self, path: PathLike, new_path: PathLike) -> None:
        record = self._pending.pop(os.fspath(path), None)
        if record is not None:
            write_record(self.root, _relative(new_path, self.root), record)
        super().rename(path, new_path)


class VerifyingFileSystem(FileSystem):
    """DCP's local file system, reading every file through :func:`open_verified`."""

    def __init__(self, root: PathLike):
        super().__init__()
        self.root = Path(root)

    @contextlib.contextmanager
    def create_stream(self, path: PathLike, mode: str):
        if "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_verified(path, self.root) as stream:
            yield stream


def safe_torch_load_verified(path: PathLike, what: str, root: Optional[PathLike] = None):
    """:func:`~megatron.core.dist_checkpointing.safe_load.safe_torch_load` of a checkpoint file, verified against
    its checksums (``root``: its checkpoint directory; default :func:`legacy_root`)."""
    from .safe_load import safe_torch_load

    if not os.path.isfile(path):
        raise CheckpointingException(f"{what} does not exist: check the path")
    with open_verified(path, legacy_root(path) if root is None else root) as file:
        return safe_torch_load(file, what)


def load_verified_config(checkpoint_dir: PathLike) -> Optional[CheckpointingConfig]:
    """:func:`~megatron.core.dist_checkpointing.core.maybe_load_config`, its ``metadata.json`` verified first."""
    path = Path(checkpoint_dir) / CONFIG_FNAME
    if not path.exists():
        return None
    return parse_config(read_verified_bytes(path, checkpoint_dir), path)


def save_verified_config(config: CheckpointingConfig, checkpoint_dir: PathLike) -> None:
    """:func:`~megatron.core.dist_checkpointing.core.save_config`, after the checksum record of ``metadata.json``."""
    content = json.dumps(dataclasses.asdict(config)).encode()
    write_small_file(Path(checkpoint_dir) / CONFIG_FNAME, checkpoint_dir, content)
