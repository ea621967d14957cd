"""ShardedTensors that PyTorch's own ``torch.distributed.checkpoint.save``/``load`` write and read.

DCP asks every value of a state dict for its write items, its chunks and the tensor behind each chunk through three
hooks (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, the protocol DTensor
implements). :class:`CheckpointableShardedTensor` answers them for one ShardedTensor, so a state dict of them is
saved as plain global tensors (the layout Megatron's torch_dist strategy writes) and loaded back into the pieces'
own ``data``, resharding as DCP does. :class:`LocalShardsContainer` puts several pieces of one global tensor held by
the same rank under a single key.

Both are tensor subclasses with the *global* shape (DCP compares it with the checkpoint's) and no storage of their
own: any tensor operation on them is refused.
"""

from typing import List

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..boxes import box_view, sharded_tensor_boxes
from ..core import CheckpointingException
from ..mapping import ShardedTensor


def _refuse_operation(cls, func):
    raise CheckpointingException(
        f"{cls.__name__} only carries ShardedTensor pieces through torch.distributed.checkpoint; the tensor "
        f"operation {func} is not supported on it (use its pieces' data)"
    )


class CheckpointableShardedTensor(torch.Tensor):
    """One ShardedTensor (``_sh_ten``) as a DCP-checkpointable value; loading fills ``_sh_ten.data`` in place."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor):
        return torch.Tensor._make_wrapper_subclass(cls, sh_ten.global_shape, dtype=sh_ten.dtype, device=data.device)

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor):
        if data is not sh_ten.data:
            raise CheckpointingException(
                f"CheckpointableShardedTensor {sh_ten.key!r}: data must be the ShardedTensor's own data"
            )
        self._sh_ten = sh_ten
        # (box, data slice) of each stored chunk; a flattened piece is several boxes (see boxes.py).
        self._boxes = [item for item in sharded_tensor_boxes(sh_ten) if item[0].numel > 0]

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        if sh_ten.data is None:
            raise CheckpointingException(
                f"CheckpointableShardedTensor {sh_ten.key!r}: the ShardedTensor has no data to save or load into"
            )
        return cls(sh_ten.data, sh_ten)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        _refuse_operation(cls, func)

    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        properties = TensorProperties(dtype=self._sh_ten.dtype)
        size = torch.Size(self._sh_ten.global_shape)
        return [
            WriteItem(
                MetadataIndex(fqn, torch.Size(box.offset)),
                WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(*self._chunk(box)), properties, size),
            )
            for box, _ in self._boxes
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(*self._chunk(box)) for box, _ in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for box, data_slice in self._boxes:
            if torch.Size(box.offset) == index.offset:
                return box_view(self._sh_ten.data, box, data_slice)
        raise CheckpointingException(
            f"CheckpointableShardedTensor {self._sh_ten.key!r} holds no chunk at offset {tuple(index.offset or ())} "
            f"(its chunks start at {[box.offset for box, _ in self._boxes]})"
        )

    @staticmethod
    def _chunk(box):
        return torch.Size(box.offset), torch.Size(box.shape)

    def __repr__(self):
        return f"CheckpointableShardedTensor({self._sh_ten})"


class LocalShardsContainer(torch.Tensor):
    """Several pieces of one global tensor held by this rank, saved and loaded under one key."""

    @staticmethod
    def __new__(cls, local_shards: List[CheckpointableShardedTensor]):
        if not local_shards:
            raise CheckpointingException("LocalShardsContainer needs at least one CheckpointableShardedTensor")
        first = local_shards[0]
        return torch.Tensor._make_wrapper_subclass(cls, first.shape, dtype=first.dtype, device=first.device)

    def __init__(self, local_shards: List[CheckpointableShardedTensor]):
        for shard in local_shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise CheckpointingException(
                    f"LocalShardsContainer holds CheckpointableShardedTensors, got {type(shard).__name__}"
                )
            if shard.shape != self.shape or shard.dtype != self.dtype:
                raise CheckpointingException(
                    f"LocalShardsContainer: piece {shard._sh_ten.key!r} has global shape {tuple(shard.shape)} and "
                    f"dtype {shard.dtype}; the first piece has {tuple(self.shape)} and {self.dtype} (all pieces must "
                    "belong to one global tensor)"
                )
        self._local_shards = list(local_shards)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        _refuse_operation(cls, func)

    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        return [item for shard in self._local_shards for item in shard.__create_write_items__(fqn, shard)]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [chunk for shard in self._local_shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for shard in self._local_shards:
            if any(torch.Size(box.offset) == index.offset for box, _ in shard._boxes):
                return shard.__get_tensor_shard__(index)
        raise CheckpointingException(
            f"LocalShardsContainer ({self._local_shards[0]._sh_ten.key!r}) holds no chunk at offset "
            f"{tuple(index.offset or ())}"
        )

    def __repr__(self):
        return f"LocalShardsContainer({len(self._local_shards)} pieces of {self._local_shards[0]._sh_ten.key!r})"
