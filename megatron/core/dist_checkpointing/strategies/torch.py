"""The ``torch_dist`` backend: shards stored in PyTorch Distributed Checkpoint (DCP) files.

On disk (the layout Megatron-LM's ``torch_dist`` backend writes): ``__<rank>_<n>.distcp`` files holding each rank's
pieces, and ``.metadata`` (a pickled ``torch.distributed.checkpoint.Metadata``) mapping every ShardedTensor key to
its global shape, dtype and stored chunks, and every ShardedObject ``unique_key`` to its bytes (``torch.save`` of a
one-element list, as Megatron stores them). Prepended axes are real axes of the stored tensor. Flattened pieces are
stored as the rectangular boxes they consist of (see ``boxes.py``), so the file holds the plain global tensor.

Saving plans every rank's writes locally, with no collective before the write; one all-gather at finalisation gives
rank 0 the chunk lists and file offsets for ``.metadata``. Loading reads ``.metadata`` and, for each requested piece,
only the stored chunks that intersect it: any saved layout reads into any requested layout.
"""

import io
import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
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
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_inplace, dict_list_map_outplace, nested_values
from ..exchange import all_gather_objects, describe_error, gather_and_raise_errors, get_rank, raise_gathered_errors
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
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
        return self.data[write_item.index]


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Write each rank's main replicas (replica_id 0) with DCP's filesystem writer, ``thread_count`` files per rank."""

    def __init__(self, backend: str = "torch_dist", version: int = 1, thread_count: int = 2):
        super().__init__(backend, version)
        self.thread_count = thread_count

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> AsyncRequest:
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
                if is_main_replica(shard.replica_id):
                    _add_write_items(shard, items, data, copy_data)
        except Exception as error:  # reported to every rank at finalisation, never raised on this rank alone
            planning_error = describe_error(error)
        writer = FileSystemWriter(checkpoint_dir, thread_count=self.thread_count, sync_files=True)
        writer.set_up_storage_writer(rank == 0, rank=rank)

        def write() -> Tuple[List[WriteResult], Optional[str]]:
            """Runs in the background worker: returns (write results, error message), never raises."""
            if planning_error is not None:
                return [], planning_error
            try:
                plan = writer.prepare_local_plan(SavePlan(items, storage_data=_StoragePrefix(f"__{rank}_")))
                return writer.write_data(plan, _StagedDataPlanner(data)).wait(), None
            except Exception as error:
                return [], describe_error(error)

        request = AsyncRequest(write, (), [])

        def finalize() -> None:
            results, write_error = request.async_fn_result
            data.clear()  # drop the staged copies
            all_writes = all_gather_objects(_RankWrites(items, results, write_error))
            raise_gathered_errors([w.error for w in all_writes], f"writing the shards of {checkpoint_dir}")
            error = None
            if rank == 0:
                try:
                    writer.finish(_global_metadata(all_writes), [w.results for w in all_writes])
                except Exception as caught:
                    error = caught
            gather_and_raise_errors(error, f"writing {checkpoint_dir / DCP_METADATA_FNAME}")

        request.add_finalize_fn(finalize)
        return request


def _add_write_items(shard, items: List[WriteItem], data: Dict[MetadataIndex, object], copy_data: bool) -> None:
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
        tensor = box_view(shard.data.detach(), box, data_slice)
        if copy_data:
            tensor = tensor.to("cpu", copy=True)
        index = MetadataIndex(shard.key, box.offset)
        chunk = ChunkStorageMetadata(torch.Size(box.offset), torch.Size(box.shape))
        items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=TensorWriteData(chunk, properties, size)))
        data[index] = tensor


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
            entry.chunks.sort(key=lambda chunk: tuple(chunk.offsets))
    return Metadata(state_dict_metadata=entries, planner_data={fqn: (fqn,) for fqn in entries})


class _PendingObject:
    """Placeholder for a ShardedObject until its bytes are read."""

    def __init__(self, name: str):
        self.name = name


class _TargetsPlanner(LoadPlanner):
    """Reads each chunk straight into a view of the requested tensor; unpickles objects."""

    def __init__(self, targets: Dict[str, torch.Tensor]):
        self.targets = targets
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
        # ShardedObjects are arbitrary Python objects (RNG states, ...): load only trusted checkpoints.
        stored = torch.load(value, map_location="cpu", weights_only=False)
        self.objects[read_item.dest_index.fqn] = stored[0] if isinstance(stored, list) and len(stored) == 1 else stored

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.targets[read_item.dest_index.fqn]
        for axis, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
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
    try:
        return FileSystemReader(checkpoint_dir).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as error:
        raise CheckpointingException(f"{path} is corrupt ({type(error).__name__}: {error})") from error


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Read exactly the requested pieces from a ``torch_dist`` checkpoint, whatever layout saved it."""

    def __init__(self, backend: str = "torch_dist", version: int = 1):
        super().__init__(backend, version)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        loaded, error = None, None
        try:
            loaded = self.load_local(sharded_state_dict, Path(checkpoint_dir))
        except Exception as caught:
            error = caught
        gather_and_raise_errors(error, f"loading {checkpoint_dir}")
        return loaded

    def load_local(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """:meth:`load` on this rank alone (no collective): errors are raised here only."""
        metadata = read_dcp_metadata(checkpoint_dir)
        reader = FileSystemReader(checkpoint_dir)
        reader.set_up_storage_reader(metadata, get_rank() == 0)
        read_items: List[ReadItem] = []
        targets: Dict[str, torch.Tensor] = {}

        def plan(leaf):
            if isinstance(leaf, ShardedObject):
                return _plan_object_read(leaf, metadata, checkpoint_dir, read_items)
            if isinstance(leaf, ShardedTensor):
                return _plan_tensor_read(leaf, metadata, checkpoint_dir, read_items, targets)
            raise CheckpointingException(f"cannot load {type(leaf).__name__} {getattr(leaf, 'key', leaf)!r}")

        loaded = dict_list_map_outplace(plan, sharded_state_dict)
        planner = _TargetsPlanner(targets)
        try:
            reader.read_data(LoadPlan(read_items), planner).wait()
        except Exception as error:
            raise CheckpointingException(
                f"reading the shards of {checkpoint_dir} failed ({type(error).__name__}: {error}); the files are "
                "missing, truncated or corrupt"
            ) from error
        return dict_list_map_inplace(
            lambda x: planner.objects[x.name] if isinstance(x, _PendingObject) else x, loaded
        )

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        metadata = read_dcp_metadata(checkpoint_dir)
        return {
            key: _whole_tensor(key, entry)
            for key, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        metadata = read_dcp_metadata(checkpoint_dir)
        entries = {}
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                entries[key] = _whole_tensor(key, entry)
            else:
                entries[key] = ShardedObject.empty_from_unique_key(key)
        return entries


def _whole_tensor(key: str, entry: TensorStorageMetadata) -> ShardedTensor:
    shape = tuple(entry.size)
    return ShardedTensor(key, None, entry.properties.dtype, shape, shape, (0,) * len(shape), (1,) * len(shape))


def _plan_object_read(shard: ShardedObject, metadata: Metadata, checkpoint_dir: Path, read_items: List[ReadItem]):
    name = shard.unique_key
    if not isinstance(metadata.state_dict_metadata.get(name), BytesStorageMetadata):
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
        raise CheckpointingException(f"ShardedTensor {shard.key!r} {what} the checkpoint {checkpoint_dir}")
    stored_shape = tuple(stored.size)
    if stored_shape != tuple(shard.global_shape) and not shard.allow_shape_mismatch:
        raise CheckpointingException(
            f"ShardedTensor {shard.key!r}: the model expects global shape {tuple(shard.global_shape)} but the "
            f"checkpoint {checkpoint_dir} stores {stored_shape}; load with the same model configuration, or set "
            "allow_shape_mismatch=True on it if the difference is intended (e.g. vocabulary padding)"
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
        if covered != wanted.numel:
            raise CheckpointingException(
                f"the checkpoint {checkpoint_dir} holds only {covered} of the {wanted.numel} elements of "
                f"ShardedTensor {shard.key!r} at offset {wanted.offset} shape {wanted.shape}; it is incomplete"
            )
    return shard.data if shard.data is not None else data


register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy("torch_dist", 1))
register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy("torch_dist", 1))
