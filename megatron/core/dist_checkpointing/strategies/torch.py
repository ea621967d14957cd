"""The ``torch_dist`` backend: shards stored in PyTorch Distributed Checkpoint (DCP) files.

On disk (the layout Megatron-LM's ``torch_dist`` backend writes): ``__<rank>_<n>.distcp`` files holding each rank's
pieces, and ``.metadata`` (a pickled ``torch.distributed.checkpoint.Metadata``) mapping every ShardedTensor key to
its global shape, dtype and stored chunks, and every ShardedObject ``unique_key`` to its bytes (``torch.save`` of a
one-element list, as Megatron stores them; the checkpoint's common state is one of them, ``common_state/shard_0_1``).
Every pickled part is read back with the safe-globals allow-list (``safe_load.py``). Prepended axes are real axes of
the stored tensor. Flattened pieces are stored as the rectangular boxes they consist of (see ``boxes.py``), so the
file holds the plain global tensor.

Saving plans every rank's writes locally, with no collective before the write; one all-gather at finalisation gives
rank 0 the chunk lists and file offsets for ``.metadata``. Loading reads ``.metadata`` and, for each requested piece,
only the stored chunks that intersect it: any saved layout reads into any requested layout.
"""

import functools
import io
import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix  # the per-rank file prefix "__<rank>_"
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from ..boxes import Box, box_view, sharded_tensor_boxes
from ..checksums import (
    ChecksummingFileSystem,
    VerifyingFileSystem,
    read_verified_bytes,
    write_small_file,
)
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_inplace, dict_list_map_outplace, nested_values
from ..exchange import all_gather_objects, describe_error, gather_and_raise_errors, get_rank, raise_gathered_errors
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ..safe_load import CorruptCheckpointError, safe_pickle_load, safe_torch_load
from .async_utils import AsyncRequest
from .base import AsyncSaveShardedStrategy, LoadShardedStrategy, StrategyAction, register_default_strategy

DCP_METADATA_FNAME = ".metadata"

logger = logging.getLogger(__name__)


@dataclass
class _RankWrites:
    """What one rank wrote, reported to rank 0 at finalisation."""

    items: List[WriteItem] = field(default_factory=list)
    results: List[WriteResult] = field(default_factory=list)
    error: Optional[str] = None


class _StagedDataPlanner(SavePlanner):
    """Hands the writer the data of each write item; the plan was made before the writer runs."""

    def __init__(self, data: Dict[MetadataIndex, object]):
        self.data = data

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(list(self.data))

    def create_global_plan(self, all_plans):
        return all_plans, None

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        data = self.data[write_item.index]
        return data() if callable(data) else data  # a deferred tensor is produced when the writer reaches it


ASYNC_STRATEGIES = ("nvrx", "mcore")


def check_async_strategy(async_strategy: str) -> None:
    """``'mcore'`` is the built-in background writer. ``'nvrx'`` (NVIDIA Resiliency Extension's writer) is not
    available here, so, as Megatron does when that package is missing, it falls back to ``'mcore'``."""
    if async_strategy not in ASYNC_STRATEGIES:
        raise CheckpointingException(
            f"async_strategy={async_strategy!r} is not one of {', '.join(map(repr, ASYNC_STRATEGIES))}"
        )


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Write each rank's main replicas (replica_id 0) with DCP's filesystem writer, ``thread_count`` files per rank.

    ``cached_metadata`` (Megatron reuses its global save plan between saves) is accepted and has no effect: this
    writer plans locally, without a collective, every time. ``keep_only_main_replica=False``, ``separation_hint``
    and ``cpu_shm_mode`` are refused as not supported yet.

    ``materialize`` (a class attribute, None here) lets a subclass write tensors that do not exist yet:
    ``materialize(shard)`` returns the data of a ShardedTensor (whose own ``data`` may then be a meta tensor) when
    the writer reaches it, so a converter streams a model to disk holding about one tensor at a time.
    """

    materialize: Optional[Callable[[ShardedTensor], torch.Tensor]] = None

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 1,
        cached_metadata: bool = False,
        separation_hint: Optional[str] = None,
        cpu_shm_mode: bool = False,
    ):
        super().__init__(backend, version)
        unsupported = {
            "writing every replica": ("keep_only_main_replica", keep_only_main_replica, True),
            "separate files per key prefix": ("separation_hint", separation_hint, None),
            "staging in shared memory": ("cpu_shm_mode", cpu_shm_mode, False),
        }
        for feature, (name, value, default) in unsupported.items():
            if value != default:
                raise ValueError(f"TorchDistSaveShardedStrategy: not supported yet: {feature} ({name}={value!r})")
        if thread_count < 1:
            raise ValueError(f"TorchDistSaveShardedStrategy: thread_count={thread_count} must be at least 1")
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.cached_metadata = cached_metadata
        self.separation_hint = separation_hint
        self.cpu_shm_mode = cpu_shm_mode

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, async_strategy: str = "nvrx"
    ) -> AsyncRequest | Any:
        check_async_strategy(async_strategy)
        return self._plan(sharded_state_dict, Path(checkpoint_dir), copy_data=True)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        # Written before returning, so the training buffers can be read in place: no staging copy.
        self._plan(sharded_state_dict, Path(checkpoint_dir), copy_data=False).execute_sync()

    def _plan(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, copy_data: bool) -> AsyncRequest:
        rank = get_rank()
        items: List[WriteItem] = []
        data: Dict[MetadataIndex, object] = {}
        planning_error = None
        try:
            for shard in nested_values(sharded_state_dict):
                # Replicas hold identical data: only the main one is written, so each piece is stored once.
                if is_main_replica(shard.replica_id):
                    _add_write_items(shard, items, data, copy_data, self.materialize)
        except Exception as error:  # reported to every rank at finalisation, never raised on this rank alone
            planning_error = describe_error(error)
        # fsync the shards: metadata.json, written after them, must never mark unsynced data as complete.
        writer = FileSystemWriter(checkpoint_dir, thread_count=self.thread_count, sync_files=True)
        # Every file is checksummed as its bytes are written (see checksums.py).
        writer.fs = ChecksummingFileSystem(checkpoint_dir)
        writer.set_up_storage_writer(rank == 0, rank=rank)

        def write() -> Tuple[List[WriteResult], Optional[str]]:
            """Runs in the background worker: returns (write results, error message), never raises."""
            if planning_error is not None:
                return [], planning_error
            try:
                # The rank in the file prefix keeps ranks from ever writing the same file.
                plan = writer.prepare_local_plan(SavePlan(items, storage_data=_StoragePrefix(f"__{rank}_")))
                return writer.write_data(plan, _StagedDataPlanner(data)).wait(), None
            except Exception as error:
                return [], describe_error(error)

        request = AsyncRequest(write, (), [])

        def finalize() -> None:
            results, write_error = request.async_fn_result
            data.clear()  # drop the staged copies
            # The save's one collective: rank 0 needs every rank's chunks and file offsets for .metadata.
            all_writes = all_gather_objects(_RankWrites(items, results, write_error))
            raise_gathered_errors([w.error for w in all_writes], f"writing the shards of {checkpoint_dir}")
            error = None
            if rank == 0:
                try:
                    writer.finish(_global_metadata(all_writes), [w.results for w in all_writes])
                except Exception as caught:
                    error = caught
            # A failure on rank 0 is raised on every rank, so none of them goes on as if the save succeeded.
            gather_and_raise_errors(error, f"writing {checkpoint_dir / DCP_METADATA_FNAME}")

        request.add_finalize_fn(finalize)
        return request


def _add_write_items(
    shard,
    items: List[WriteItem],
    data: Dict[MetadataIndex, object],
    copy_data: bool,
    materialize: Optional[Callable[[ShardedTensor], torch.Tensor]] = None,
) -> None:
    if isinstance(shard, ShardedObject):
        buffer = io.BytesIO()
        torch.save([shard.data], buffer)
        index = MetadataIndex(shard.unique_key)
        items.append(WriteItem(index, WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(buffer.getbuffer().nbytes)))
        data[index] = buffer
        return
    if not isinstance(shard, ShardedTensor):
        raise CheckpointingException(f"cannot save {type(shard).__name__} {shard.key!r}; apply factories first")
    properties = TensorProperties(dtype=shard.dtype)
    size = torch.Size(shard.global_shape)
    for box, data_slice in sharded_tensor_boxes(shard):
        if box.numel == 0:
            continue
        index = MetadataIndex(shard.key, box.offset)
        chunk = ChunkStorageMetadata(torch.Size(box.offset), torch.Size(box.shape))
        items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=TensorWriteData(chunk, properties, size)))
        if materialize is not None:
            data[index] = functools.partial(_materialized_box, materialize, shard, box, data_slice)
            continue
        tensor = box_view(shard.data.detach(), box, data_slice)
        if copy_data:
            # Async: snapshot now, since training goes on changing the tensor while the background write runs.
            tensor = tensor.to("cpu", copy=True)
        data[index] = tensor


def _materialized_box(materialize, shard: ShardedTensor, box: Box, data_slice) -> torch.Tensor:
    return box_view(materialize(shard).detach(), box, data_slice)


def _global_metadata(all_writes: List[_RankWrites]) -> Metadata:
    entries = {}
    for writes in all_writes:
        for item in writes.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                entries[fqn] = BytesStorageMetadata()
                continue
            tensor_data = item.tensor_data
            entry = entries.setdefault(fqn, TensorStorageMetadata(tensor_data.properties, tensor_data.size, []))
            entry.chunks.append(tensor_data.chunk)
    for entry in entries.values():
        if isinstance(entry, TensorStorageMetadata):
            # A fixed order by offset, whichever rank wrote each chunk.
            entry.chunks.sort(key=lambda chunk: tuple(chunk.offsets))
    return Metadata(state_dict_metadata=entries, planner_data={fqn: (fqn,) for fqn in entries})


class _PendingObject:
    """Placeholder for a ShardedObject until its bytes are read."""

    def __init__(self, name: str):
        self.name = name


class _TargetsPlanner(LoadPlanner):
    """Reads each chunk straight into a view of the requested tensor; unpickles objects with the allow-list."""

    def __init__(self, targets: Dict[str, torch.Tensor], files: "_ShardFiles"):
        self.targets = targets
        self.files = files
        self.objects: Dict[str, object] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([])

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        stored = self.files.load_object(read_item.storage_index.fqn, value)
        # Objects are stored as a one-element list (Megatron's format); unwrap it.
        self.objects[read_item.dest_index.fqn] = stored[0] if isinstance(stored, list) and len(stored) == 1 else stored

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.targets[read_item.dest_index.fqn]
        for axis, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            # A view into the requested tensor, so the reader copies straight into place.
            target = target.narrow(axis, offset, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # the reader copied into the view resolve_tensor returned


def read_dcp_metadata(checkpoint_dir: Path) -> Metadata:
    """The DCP ``.metadata`` of ``checkpoint_dir``, with errors naming the file."""
    path = Path(checkpoint_dir) / DCP_METADATA_FNAME
    if not path.exists():
        raise CheckpointingException(
            f"{path} is missing: the checkpoint {checkpoint_dir} is incomplete (its save did not finish)"
        )
    # Verified against its checksums, then read with the allow-list: torch's own reader would unpickle whatever
    # the file names.
    metadata = safe_pickle_load(io.BytesIO(read_verified_bytes(path, checkpoint_dir)), str(path))
    if not isinstance(metadata, Metadata):
        raise CheckpointingException(f"{path} is corrupt (it holds a {type(metadata).__name__}, not DCP Metadata)")
    return metadata


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Read exactly the requested pieces from a ``torch_dist`` checkpoint, whatever layout saved it.

    With ``cache_metadata`` the ``.metadata`` read for a checkpoint directory is kept for the next call on the same
    directory. ``stream_ckpt_dequant`` concerns FP8 tensors, which this project does not store; it has no effect.
    ``checkpoint_name`` names the checkpoint in error messages (default: its directory).
    """

    def __init__(self, cache_metadata: bool = False, stream_ckpt_dequant: bool = True, checkpoint_name: str = None):
        super().__init__("torch_dist", 1)
        self.cache_metadata = cache_metadata
        self.stream_ckpt_dequant = stream_ckpt_dequant
        self.checkpoint_name = checkpoint_name
        self._cached: Optional[Tuple[Path, Metadata]] = None

    def _metadata(self, checkpoint_dir: Path, metadata: Optional[Metadata] = None) -> Metadata:
        if metadata is not None:
            return metadata
        checkpoint_dir = Path(checkpoint_dir)
        if self.cache_metadata and self._cached is not None and self._cached[0] == checkpoint_dir:
            return self._cached[1]
        metadata = read_dcp_metadata(checkpoint_dir)
        if self.cache_metadata:
            self._cached = (checkpoint_dir, metadata)
        return metadata

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, async_strategy: str = "mcore"
    ) -> StateDict:
        """Collective. Reading is synchronous whatever ``async_strategy`` ('mcore' or 'nvrx') names."""
        loaded, error = None, None
        try:
            check_async_strategy(async_strategy)
            loaded = self.load_local(sharded_state_dict, Path(checkpoint_dir))
        except Exception as caught:
            error = caught
        gather_and_raise_errors(error, f"loading {checkpoint_dir}")
        return loaded

    def load_local(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """:meth:`load` on this rank alone (no collective): errors are raised here only."""
        checkpoint_dir = Path(checkpoint_dir)
        metadata = self._metadata(checkpoint_dir)
        read_items: List[ReadItem] = []
        targets: Dict[str, torch.Tensor] = {}

        def plan(leaf):
            if isinstance(leaf, ShardedObject):
                return _plan_object_read(leaf, metadata, checkpoint_dir, read_items)
            if isinstance(leaf, ShardedTensor):
                return _plan_tensor_read(leaf, metadata, checkpoint_dir, read_items, targets)
            raise CheckpointingException(f"cannot load {type(leaf).__name__} {getattr(leaf, 'key', leaf)!r}")

        loaded = dict_list_map_outplace(plan, sharded_state_dict)
        files = _ShardFiles(checkpoint_dir, metadata, self.checkpoint_name)
        files.check_sizes(read_items)
        planner = _TargetsPlanner(targets, files)
        files.read(read_items, planner)
        return dict_list_map_inplace(lambda x: planner.objects[x.name] if isinstance(x, _PendingObject) else x, loaded)

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Metadata = None):
        metadata = self._metadata(checkpoint_dir, metadata)
        return {
            key: _whole_tensor(key, entry)
            for key, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        metadata = self._metadata(checkpoint_dir)
        entries = {}
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                entries[key] = _whole_tensor(key, entry)
            else:
                entries[key] = ShardedObject.empty_from_unique_key(key)
        return entries

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Drop every stored tensor whose key starts with ``key_prefix`` from the checkpoint's ``.metadata`` (one
        rank, no collective): later loads no longer see them. Their bytes stay in the ``.distcp`` files."""
        checkpoint_dir = Path(checkpoint_dir)
        metadata = read_dcp_metadata(checkpoint_dir)
        removed = {
            key
            for key, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata) and key.startswith(key_prefix)
        }
        for key in removed:
            del metadata.state_dict_metadata[key]
            if metadata.planner_data:
                metadata.planner_data.pop(key, None)
        if metadata.storage_data:
            metadata.storage_data = {
                index: info for index, info in metadata.storage_data.items() if index.fqn not in removed
            }
        # Write-then-rename (a crash leaves the old .metadata or the new one), after its new checksum record.
        write_small_file(checkpoint_dir / DCP_METADATA_FNAME, checkpoint_dir, pickle.dumps(metadata))
        self._cached = None


class _ShardFiles:
    """The ``.distcp`` files a load reads: checked before reading, and named (with the rank) in every error."""

    def __init__(self, checkpoint_dir: Path, metadata: Metadata, checkpoint_name: Optional[str]):
        self.checkpoint_dir = checkpoint_dir
        self.metadata = metadata
        self.name = checkpoint_name or str(checkpoint_dir)

    def file_of(self, index: MetadataIndex) -> Path:
        return self.checkpoint_dir / self.metadata.storage_data[index].relative_path

    def load_object(self, fqn: str, value: io.BytesIO):
        """Unpickle a ShardedObject's bytes with the allow-list; damage is reported like a damaged file."""
        path = self.file_of(MetadataIndex(fqn))
        try:
            return safe_torch_load(value, f"ShardedObject {fqn!r} in {path} of checkpoint {self.name}")
        except CorruptCheckpointError as error:
            raise self._damaged(path, str(error)) from error

    def _damaged(self, path: Path, problem: str) -> CheckpointingException:
        return CheckpointingException(
            f"rank {get_rank()} could not read {path}: {problem}. The checkpoint {self.name} is damaged; load an "
            "earlier checkpoint (--ckpt-step <iteration>, or write its iteration into "
            "latest_checkpointed_iteration.txt) or delete this checkpoint directory and resume from the previous one"
        )

    def check_sizes(self, read_items: List[ReadItem]) -> None:
        """Missing or truncated files are found from the stored offsets, before reading anything."""
        needed: Dict[Path, int] = {}
        for item in read_items:
            info = self.metadata.storage_data.get(item.storage_index)
            if info is None:
                raise CheckpointingException(
                    f"{self.checkpoint_dir / DCP_METADATA_FNAME} has no file entry for {item.storage_index.fqn!r}: "
                    f"the checkpoint {self.name} is corrupt"
                )
            path = self.checkpoint_dir / info.relative_path
            # Each file must be at least as long as the furthest byte any item reads from it.
            needed[path] = max(needed.get(path, 0), info.offset + info.length)
        for path, size in needed.items():
            if not path.exists():
                raise self._damaged(path, "the file is missing")
            actual = path.stat().st_size
            if actual < size:
                raise self._damaged(path, f"the file is truncated ({actual} bytes, the checkpoint needs {size})")

    def read(self, read_items: List[ReadItem], planner: LoadPlanner) -> None:
        try:
            self._read(read_items, planner)
        except CheckpointingException:
            raise
        except Exception as error:
            raise self._damaged(self._failing_file(read_items, planner, error), _short(error)) from error

    def _read(self, read_items: List[ReadItem], planner: LoadPlanner) -> None:
        reader = FileSystemReader(self.checkpoint_dir)
        reader.fs = VerifyingFileSystem(self.checkpoint_dir)  # every byte checked against its checksum
        reader.set_up_storage_reader(self.metadata, get_rank() == 0)
        reader.read_data(LoadPlan(read_items), planner).wait()

    def _failing_file(self, read_items: List[ReadItem], planner: LoadPlanner, error: Exception) -> Path:
        """The first file whose items fail when read on their own (the reader does not say which one failed)."""
        by_file: Dict[Path, List[ReadItem]] = {}
        for item in read_items:
            by_file.setdefault(self.file_of(item.storage_index), []).append(item)
        for path, items in by_file.items():
            try:
                # Read again file by file to name the damaged one.
                self._read(items, planner)
            except Exception:
                return path
        return next(iter(by_file), self.checkpoint_dir)


def _short(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"its content is corrupt ({type(error).__name__}{': ' + text[0][:200] if text else ''})"


def _whole_tensor(key: str, entry: TensorStorageMetadata) -> ShardedTensor:
    shape = tuple(entry.size)
    return ShardedTensor(key, None, entry.properties.dtype, shape, shape, (0,) * len(shape), (1,) * len(shape))


def _plan_object_read(shard: ShardedObject, metadata: Metadata, checkpoint_dir: Path, read_items: List[ReadItem]):
    name = shard.unique_key
    if not isinstance(metadata.state_dict_metadata.get(name), BytesStorageMetadata):
        if shard.key.endswith("_extra_state"):
            # A module's extra state (Transformer Engine's FP8 metadata, empty without FP8) that the saving model
            # did not have, e.g. a local-spec checkpoint read by Transformer Engine's layout: nothing to restore.
            return None
        raise CheckpointingException(
            f"ShardedObject {shard.key!r} shard {tuple(shard.global_offset)} of {tuple(shard.global_shape)} "
            f"({name!r}) is not in the checkpoint {checkpoint_dir}"
        )
    index = MetadataIndex(name)
    read_items.append(ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0])))
    return _PendingObject(name)


def _plan_tensor_read(
    shard: ShardedTensor,
    metadata: Metadata,
    checkpoint_dir: Path,
    read_items: List[ReadItem],
    targets: Dict[str, torch.Tensor],
) -> torch.Tensor:
    stored = metadata.state_dict_metadata.get(shard.key)
    if not isinstance(stored, TensorStorageMetadata):
        what = "is not in" if stored is None else "is an object, not a tensor, in"
        raise CheckpointingException(
            f"ShardedTensor {shard.key!r} {what} the checkpoint {checkpoint_dir}{_bucket_layout_hint(shard.key)}"
        )
    stored_shape = tuple(stored.size)
    if stored_shape != tuple(shard.global_shape) and not shard.allow_shape_mismatch:
        fix = _bucket_layout_hint(shard.key) or (
            "; load with the same model configuration, or set allow_shape_mismatch=True on it if the difference is "
            "intended (e.g. vocabulary padding)"
        )
        raise CheckpointingException(
            f"ShardedTensor {shard.key!r}: the model expects global shape {tuple(shard.global_shape)} but the "
            f"checkpoint {checkpoint_dir} stores {stored_shape}{fix}"
        )
    if shard.data is not None:
        data = shard.data.detach()
    else:
        flat = shard.flattened_range
        data = torch.empty(shard.local_shape if flat is None else (flat.stop - flat.start,), dtype=shard.dtype)
    if shard.allow_shape_mismatch:
        data.zero_()  # what lies outside the stored tensor stays zero
    stored_extent = Box((0,) * len(stored_shape), stored_shape)
    for box, data_slice in sharded_tensor_boxes(shard):
        wanted = box.intersection(stored_extent)
        if wanted is None:
            continue
        # A unique name per requested box: the planner finds the target view by this fqn.
        target_name = str(len(targets))
        targets[target_name] = box_view(data, box, data_slice)
        covered = 0
        for chunk_index, chunk in enumerate(stored.chunks):
            overlap = wanted.intersection(Box(tuple(chunk.offsets), tuple(chunk.sizes)))
            if overlap is None:
                continue
            covered += overlap.numel
            read_items.append(
                ReadItem(
                    LoadItemType.TENSOR,
                    MetadataIndex(target_name),
                    torch.Size(overlap.relative_to(box.offset)),
                    MetadataIndex(shard.key, chunk.offsets, chunk_index),
                    torch.Size(overlap.relative_to(tuple(chunk.offsets))),
                    torch.Size(overlap.shape),
                )
            )
        # Stored chunks do not overlap, so a shortfall means part of the tensor was never written.
        if covered != wanted.numel:
            raise CheckpointingException(
                f"the checkpoint {checkpoint_dir} holds only {covered} of the {wanted.numel} elements of "
                f"ShardedTensor {shard.key!r} at offset {wanted.offset} shape {wanted.shape}; it is incomplete"
            )
    return shard.data if shard.data is not None else data


class MCoreSavePlanner(DefaultSavePlanner):
    """A planner for ``torch.distributed.checkpoint.save`` that writes an ``io.BytesIO`` value as its bytes, the
    way ShardedObjects are stored (PyTorch's default planner would ``torch.save`` the BytesIO object itself): a
    state dict holding ``{"common_state/shard_0_1": BytesIO(torch.save([state]))}`` and tensors is then a checkpoint
    this project (and Megatron-Core) loads. ``dedup_replicated_tensors`` goes to PyTorch's planner;
    ``can_run_decentralized_global_plan`` is kept for Megatron's callers (this project's writer plans each rank's
    writes locally anyway)."""

    def __init__(
        self,
        *args,
        dedup_replicated_tensors: Optional[bool] = None,
        can_run_decentralized_global_plan: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(*args, dedup_replicated_tensors=dedup_replicated_tensors, **kwargs)
        self.can_run_decentralized_global_plan = can_run_decentralized_global_plan

    def transform_object(self, write_item: WriteItem, object: Any):
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            # Already the serialized bytes of a ShardedObject: write them as they are.
            return object
        return super().transform_object(write_item, object)


class MCoreLoadPlanner(DefaultLoadPlanner):
    """A planner for ``torch.distributed.checkpoint.load`` that first checks the checkpoint's global shapes against
    ``shapes_validation_sharded_tensors`` (ShardedTensors describing what the caller expects), raising a
    CheckpointingException that names the key and both shapes, except for keys in
    ``allow_shape_mismatch_sharded_tensors`` ({state dict key: ShardedTensor}): a tensor there whose shape differs
    from the stored one receives the part both cover and zeros elsewhere (e.g. a padded vocabulary).
    ``stream_ckpt_dequant`` concerns FP8 checkpoints; no effect here."""

    def __init__(
        self,
        *args,
        shapes_validation_sharded_tensors: Iterable[ShardedTensor] = (),
        allow_shape_mismatch_sharded_tensors: Optional[Dict[str, ShardedTensor]] = None,
        stream_ckpt_dequant: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = list(shapes_validation_sharded_tensors)
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors or {}
        self.stream_ckpt_dequant = stream_ckpt_dequant

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        for sharded_tensor in self.shapes_validation_sharded_tensors:
            if sharded_tensor.key in self.allow_shape_mismatch_sharded_tensors:
                continue
            entry = stored.get(sharded_tensor.key)
            if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != tuple(sharded_tensor.global_shape):
                raise CheckpointingException(
                    f"ShardedTensor {sharded_tensor.key!r}: the checkpoint stores global shape {tuple(entry.size)} "
                    f"but {tuple(sharded_tensor.global_shape)} is expected"
                )
        self._mismatched: Dict[str, torch.Tensor] = {}
        for key in self.allow_shape_mismatch_sharded_tensors:
            entry, target = stored.get(key), self.state_dict.get(key)
            if isinstance(entry, TensorStorageMetadata) and isinstance(target, torch.Tensor):
                if tuple(entry.size) != tuple(target.shape):
                    # Read the stored tensor whole into a buffer; commit_tensor copies the common part over.
                    self._mismatched[key] = target.zero_()
                    self.state_dict[key] = torch.zeros(tuple(entry.size), dtype=target.dtype)
        return super().create_local_plan()

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        target = self._mismatched.get(read_item.dest_index.fqn)
        if target is None:
            return
        stored_box = Box(tuple(read_item.dest_offsets), tuple(read_item.lengths))
        common = stored_box.intersection(Box((0,) * target.ndim, tuple(target.shape)))
        if common is not None:
            source = self.state_dict[read_item.dest_index.fqn]
            index = tuple(slice(o, o + n) for o, n in zip(common.offset, common.shape))
            target[index] = source[index]


def flatten_state_dict(state_dict: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, tuple[str | int, ...]]]:
    """(a one-level dict whose keys are the dot-joined paths of ``state_dict``'s leaves, {flat key: path}); list
    positions are path elements too. Raises when two paths join to the same key."""
    flat: Dict[str, Any] = {}
    paths: Dict[str, tuple] = {}

    def visit(value, path):
        if isinstance(value, dict) and value or isinstance(value, list) and value:
            for k, v in value.items() if isinstance(value, dict) else enumerate(value):
                visit(v, path + (k,))
            return
        key = ".".join(map(str, path))
        if key in flat:
            raise CheckpointingException(f"flatten_state_dict: {paths[key]} and {path} both flatten to {key!r}")
        flat[key], paths[key] = value, path

    for k, v in state_dict.items():
        visit(v, (k,))
    return flat, paths


register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy("torch_dist", 1))
register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy())


def _bucket_layout_hint(key: str) -> str:
    """What to do when a distributed optimizer's bucket-space (dp_reshardable) tensor does not fit this run."""
    if ".bucket_idx_" not in key or "optimizer.distributed." not in key:
        return ""
    return (
        ": this dp_reshardable distributed-optimizer checkpoint was written for other buckets; it reloads only with "
        "the same model, tensor/pipeline layout and --ddp-bucket-size (at any data-parallel size). Save it with "
        "--dist-ckpt-optim-fully-reshardable to change them, or pass --no-load-optim"
    )
