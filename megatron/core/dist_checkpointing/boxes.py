"""Rectangular boxes of a global tensor: what a ShardedTensor's data covers, and how pieces intersect.

A whole piece is one box. A flattened piece (``flattened_range`` of the flattened local shape) is in general not a
box, but it is the union of a few (at most ``2 * ndim - 1``) boxes that are each contiguous in the flat order; they
are what the checkpoint stores, so the file holds the plain global tensor whatever flat slicing saved it, and any
other layout, flat or not, reads it back.
"""

from dataclasses import dataclass
from math import prod
from typing import List, Optional, Tuple

import torch

from .mapping import ShardedTensor


@dataclass(frozen=True)
class Box:
    """``shape`` elements starting at ``offset``, in global coordinates (prepended axes included)."""

    offset: Tuple[int, ...]
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def intersection(self, other: "Box") -> Optional["Box"]:
        """The common part of two boxes, or None when they do not overlap."""
        starts = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        ends = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offset, self.shape, other.offset, other.shape))
        if any(end <= start for start, end in zip(starts, ends)):
            return None
        return Box(starts, tuple(end - start for start, end in zip(starts, ends)))

    def relative_to(self, origin: Tuple[int, ...]) -> Tuple[int, ...]:
        return tuple(o - p for o, p in zip(self.offset, origin))


def flat_range_boxes(
    shape: Tuple[int, ...], start: int, stop: int
) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], int]]:
    """Split elements ``[start, stop)`` of a C-ordered array of ``shape`` into boxes contiguous in flat order.

    Returns ``(offset, box_shape, flat_start)`` triples in flat order. Each step takes the largest box that starts
    at the current position: whole trailing sub-arrays along the first axis the position is aligned to.
    """
    if not shape:
        return [((), (), start)] if stop > start else []
    strides = [prod(shape[axis + 1 :]) for axis in range(len(shape))]
    boxes = []
    position = start
    while position < stop:
        axis = next(a for a in range(len(shape)) if position % strides[a] == 0 and strides[a] <= stop - position)
        coordinates = [(position // strides[a]) % shape[a] for a in range(len(shape))]
        count = min((stop - position) // strides[axis], shape[axis] - coordinates[axis])
        offset = tuple(coordinates[: axis + 1]) + (0,) * (len(shape) - axis - 1)
        box_shape = (1,) * axis + (count,) + tuple(shape[axis + 1 :])
        boxes.append((offset, box_shape, position))
        position += count * strides[axis]
    return boxes


def sharded_tensor_boxes(sh_ten: ShardedTensor) -> List[Tuple[Box, Optional[slice]]]:
    """The boxes of the global tensor ``sh_ten`` holds, each with the slice of its 1-D ``data`` that fills it
    (None: the box is all of ``data``, seen with the prepended axes as size-1 axes)."""
    prepended = tuple(sh_ten.global_offset[: sh_ten.prepend_axis_num])
    piece_offset = tuple(sh_ten.global_offset[sh_ten.prepend_axis_num :])
    ones = (1,) * sh_ten.prepend_axis_num
    if sh_ten.flattened_range is None:
        return [(Box(tuple(sh_ten.global_offset), ones + tuple(sh_ten.local_shape)), None)]
    start, stop = sh_ten.flattened_range.start, sh_ten.flattened_range.stop
    boxes = []
    for offset, box_shape, flat_start in flat_range_boxes(tuple(sh_ten.local_shape), start, stop):
        global_offset = prepended + tuple(p + o for p, o in zip(piece_offset, offset))
        data_slice = slice(flat_start - start, flat_start - start + prod(box_shape))
        boxes.append((Box(global_offset, ones + box_shape), data_slice))
    return boxes


def box_view(data: torch.Tensor, box: Box, data_slice: Optional[slice]) -> torch.Tensor:
    """``data`` (or its ``data_slice``) viewed with ``box.shape``; a view, so writes land in ``data``."""
    if data_slice is None:
        return data[(None,) * (len(box.shape) - data.ndim)]
    if data.stride(0) != 1:
        raise ValueError(f"flattened ShardedTensor data must be contiguous, got stride {data.stride()}")
    return data[data_slice].view(box.shape)
