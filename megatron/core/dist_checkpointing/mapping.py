"""How a rank's local state maps onto the global checkpoint.

A *sharded state dict* is a nested dict/list whose leaves are :class:`ShardedBase` objects (and plain values: the
common state, saved once, from rank 0, as the ShardedObject ``common_state``). A :class:`ShardedTensor` says "my
``data`` is the piece of global tensor ``key`` (shape ``global_shape``) that starts at ``global_offset``"; loading
fills ``data`` with that piece whatever layout wrote the checkpoint. ``replica_id`` marks copies of the same piece
held by several ranks (data parallel, or TP for replicated weights): replica 0 -- an int 0 or a tuple of zeros -- is
the main replica.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace

StateDict = Dict[str, Any]
CommonStateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]
ReplicaId = Union[int, Tuple[int, ...]]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for replica 0: the int 0 or a tuple of zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase(ABC):
    """A leaf of a sharded state dict: something with a global ``key`` that some ranks hold a piece of."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise :class:`CheckpointingException` when the fields contradict each other."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy with ``data`` dropped (what is exchanged between ranks for validation)."""


@dataclass
class ShardedTensor(ShardedBase):
    """The local piece ``data`` of global tensor ``key``.

    ``local_shape`` is ``data``'s shape (without the prepended axes); ``global_shape`` and ``global_offset`` have
    ``prepend_axis_num`` extra leading axes that exist only globally (e.g. the layer axis of stacked layers): the
    piece sits at integer index ``global_offset[i]`` on those. ``axis_fragmentations`` is how many pieces each axis
    is cut into (None for uneven pieces). With ``flattened_range`` set, ``data`` is a 1-D slice of the flattened
    local piece (the distributed optimizer's flat shards). ``allow_shape_mismatch`` lets a load read a checkpoint
    whose global shape differs (e.g. padded vocabularies): the part of the piece inside the stored tensor is read,
    the rest is zeroed.
    """

    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self):
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} must have the same number of axes"
            )
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: local_shape {self.local_shape} plus prepend_axis_num="
                f"{self.prepend_axis_num} must have as many axes as global_shape {self.global_shape}"
            )
        unprepended = slice(self.prepend_axis_num, None)
        for axis, (offset, size, global_size) in enumerate(
            zip(self.global_offset[unprepended], self.local_shape, self.global_shape[unprepended])
        ):
            if self.has_regular_grid and size != 0 and offset % size != 0:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: global_offset {offset} on axis {axis + self.prepend_axis_num} is not "
                    f"a multiple of the local size {size}; pieces on a regular grid (axis_fragmentations set) must "
                    "tile it evenly -- pass axis_fragmentations=None for uneven pieces"
                )
            if offset + size > global_size:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: the piece [{offset}, {offset + size}) on axis "
                    f"{axis + self.prepend_axis_num} lies outside the global shape {self.global_shape}"
                )
        if self.data is None:
            return
        if self.data.dtype != self.dtype:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: data dtype {self.data.dtype} differs from dtype {self.dtype}"
            )
        if self.flattened_range is None:
            if tuple(self.data.shape) != tuple(self.local_shape):
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: data shape {tuple(self.data.shape)} differs from local_shape "
                    f"{tuple(self.local_shape)}"
                )
            return
        start, stop = self.flattened_range.start, self.flattened_range.stop
        local_numel = _numel(self.local_shape)
        if self.flattened_range.step not in (None, 1) or not 0 <= start <= stop <= local_numel:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: flattened_range {self.flattened_range} must be a step-1 slice inside "
                f"[0, {local_numel}) of the flattened local_shape {tuple(self.local_shape)}"
            )
        if self.data.ndim != 1 or self.data.numel() != stop - start:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: with flattened_range {self.flattened_range} data must be 1-D with "
                f"{stop - start} elements, got shape {tuple(self.data.shape)}"
            )

    @property
    def has_regular_grid(self) -> bool:
        """True when the pieces of this tensor tile it evenly (``axis_fragmentations`` is set)."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of this piece in the global tensor (ints on the prepended axes, slices on the others)."""
        prepended = self.global_offset[: self.prepend_axis_num]
        sliced = (
            slice(offset, offset + size)
            for offset, size in zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
        )
        return tuple(chain(prepended, sliced))

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Grid coordinates of this piece: its offset in units of pieces along every axis."""
        coordinates = list(self.global_offset[: self.prepend_axis_num])
        for offset, size in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
            coordinates.append(offset // size if size else 0)
        return tuple(coordinates)

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """This piece cut to ``data.narrow(dim, start, length)``, as a piece of the correspondingly cut global tensor.

        Every rank cuts its piece the same way, so along ``dim`` (a local axis) the global tensor keeps its number of
        pieces and each piece shrinks to ``length``. Returns a list (one piece), as Megatron does.
        """
        if self.flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: narrow() cuts whole pieces; this one has flattened_range "
                f"{self.flattened_range}"
            )
        if not 0 <= dim < len(self.local_shape):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: narrow() axis {dim} does not exist; the local piece has "
                f"{len(self.local_shape)} axes"
            )
        size = self.local_shape[dim]
        if start < 0 or length < 0 or start + length > size:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: narrow({dim}, {start}, {length}) leaves the local size {size} "
                f"of axis {dim}"
            )
        axis = dim + self.prepend_axis_num
        if not self.has_regular_grid and self.global_shape[axis] != size:
            # Uneven pieces: the other ranks' cut offsets cannot be derived from this piece alone.
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: narrow() on axis {dim}, which is split into uneven pieces "
                "(axis_fragmentations=None); narrow only regular-grid pieces or whole axes"
            )
        pieces = self.global_shape[axis] // size if size else 1
        piece_index = self.global_offset[axis] // size if size else 0
        local_shape = list(self.local_shape)
        local_shape[dim] = length
        global_shape = list(self.global_shape)
        global_shape[axis] = pieces * length
        global_offset = list(self.global_offset)
        global_offset[axis] = piece_index * length
        data = None if self.data is None else self.data.narrow(dim, start, length)
        narrowed = replace(
            self,
            data=data,
            local_shape=tuple(local_shape),
            global_shape=tuple(global_shape),
            global_offset=tuple(global_offset),
        )
        return [narrowed]

    def init_data(self, device: Union[str, torch.device], init_fn=torch.empty) -> None:
        """Allocate ``data`` (when it is None) with the shape this piece has in memory."""
        if self.data is not None:
            return
        self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)
        if self.flattened_range is not None:
            self.data = self.data.flatten()[self.flattened_range]

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: Optional[slice] = None,
        **init_kwargs,
    ) -> "ShardedTensor":
        """A piece of a regular grid: each ``(axis, axis_rank_offset, axis_fragmentations)`` says ``data`` is piece
        number ``axis_rank_offset`` of ``axis_fragmentations`` equal pieces along ``axis`` (axes counted with the
        ``prepend_axis_num`` prepended ones, along which ``data`` has implicit size 1). Unlisted axes are whole."""
        if flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: from_rank_offsets builds whole pieces; use from_rank_offsets_flat for a "
                "flattened_range"
            )
        ndim = data.ndim + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        axis_fragmentations = [1] * ndim
        seen_axes = set()
        for axis, axis_rank_offset, axis_fragm in rank_offsets:
            if not 0 <= axis < ndim:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: axis {axis} does not exist (data has {data.ndim} axes plus "
                    f"{prepend_axis_num} prepended)"
                )
            if axis in seen_axes:
                raise CheckpointingException(f"ShardedTensor {key!r}: axis {axis} is listed twice in rank_offsets")
            if not 0 <= axis_rank_offset < axis_fragm:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: rank offset {axis_rank_offset} on axis {axis} must lie in "
                    f"[0, {axis_fragm}) (the axis fragmentation)"
                )
            seen_axes.add(axis)
            piece_size = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = axis_fragm * piece_size
            global_offset[axis] = axis_rank_offset * piece_size
            axis_fragmentations[axis] = axis_fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(axis_fragmentations),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *args,
        flattened_range: Optional[slice] = None,
        **kwargs,
    ) -> "ShardedTensor":
        """Like :meth:`from_rank_offsets` for a 1-D ``data`` that is ``flattened_range`` of the flattened piece of
        shape ``non_flat_local_shape``."""
        if flattened_range is None:
            raise CheckpointingException(f"ShardedTensor {key!r}: from_rank_offsets_flat needs a flattened_range")
        if data.ndim != 1:
            raise CheckpointingException(f"ShardedTensor {key!r}: flat data must be 1-D, got shape {tuple(data.shape)}")
        meta_piece = torch.empty(*non_flat_local_shape, dtype=data.dtype, device="meta")
        whole = cls.from_rank_offsets(key, meta_piece, *args, **kwargs)
        return replace(whole, data=data, flattened_range=flattened_range)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@dataclass
class ShardedObject(ShardedBase):
    """A non-tensor object (RNG state, scheduler state, ...) that is piece ``global_offset`` of a grid of shape
    ``global_shape`` of such objects. Saved as bytes under :attr:`unique_key`."""

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self):
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} must have the same number of axes"
            )
        if any(not 0 <= o < s for o, s in zip(self.global_offset, self.global_shape)):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_offset {self.global_offset} lies outside global_shape "
                f"{self.global_shape}"
            )

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offsets>_<shape>``, e.g. ``rng_state/shard_0.1_1.2``: the name the bytes are stored under."""
        offsets = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offsets}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """The data-less ShardedObject that :attr:`unique_key` names."""
        key, _, shard = unique_key.rpartition("/")
        parts = shard.split("_")
        if not key or len(parts) != 3 or parts[0] != "shard":
            raise CheckpointingException(
                f"{unique_key!r} is not a ShardedObject key of the form <key>/shard_<offsets>_<shape>"
            )
        offset = tuple(int(x) for x in parts[1].split("."))
        shape = tuple(int(x) for x in parts[2].split("."))
        return cls(key, None, shape, offset, replica_id)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor stored differently from how it lives in memory (fused QKV, SwiGLU's fused fc1, ...).

    On save, ``build_fn(key, data, replica_id, flattened_range)`` turns ``data`` into a sharded state dict of the
    stored pieces; on load, the same pieces are loaded and ``merge_fn(loaded_sub_state_dict)`` reassembles the
    in-memory tensor.
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check until built; the built pieces are validated as ShardedTensors."""

    def without_data(self) -> "ShardedTensorFactory":
        raise CheckpointingException(
            f"ShardedTensorFactory {self.key!r} must be built (apply_factories) before its metadata is exchanged"
        )


class LocalNonpersistentObject:
    """A value that is neither saved nor loaded: ``load`` returns it unwrapped, as the caller had it."""

    def __init__(self, obj):
        self.obj = obj

    def unwrap(self):
        return self.obj


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ShardedTensorFactory in place by the sub-state-dict it builds."""

    def build_if_factory(x):
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(build_if_factory, sharded_state_dict)


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict, key: Tuple[str, ...] = ()) -> StateDict:
    """Replace, in the loaded state dict ``x1``, each factory's loaded sub-state-dict by ``merge_fn`` of it.

    ``x2`` holds only the factories, at their places in the state dict (lists given as ``{index: value}``
    dicts, as :func:`~.dict_utils.extract_matching_values` returns them with ``return_lists_as_dicts``).
    """
    loaded, factories = x1, x2
    if isinstance(factories, ShardedTensorFactory):
        return factories.merge_fn(loaded)
    children = factories.items() if isinstance(factories, dict) else enumerate(factories)
    for k, sub_factories in children:
        present = k in loaded if isinstance(loaded, dict) else isinstance(k, int) and 0 <= k < len(loaded)
        if not present:
            raise CheckpointingException(
                f"the loaded state dict has nothing at {key + (k,)}, where a ShardedTensorFactory needs its pieces"
            )
        loaded[k] = apply_factory_merges(loaded[k], sub_factories, key + (k,))
    return loaded
