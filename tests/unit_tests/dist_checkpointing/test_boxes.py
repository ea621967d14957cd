"""A flattened range splits into few boxes, each contiguous in flat order, that tile the range exactly."""

import itertools
from math import prod

import torch

from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.boxes import Box, box_view, flat_range_boxes, sharded_tensor_boxes


def test_flat_ranges_of_every_small_shape_tile_exactly():
    for shape in [(), (5,), (3, 4), (2, 3, 4), (2, 1, 3, 2)]:
        numel = prod(shape)
        flat_index = torch.arange(numel).view(shape) if shape else torch.tensor(0)
        for start, stop in itertools.combinations_with_replacement(range(numel + 1), 2):
            boxes = flat_range_boxes(shape, start, stop)
            covered = []
            for offset, box_shape, flat_start in boxes:
                index = tuple(slice(o, o + s) for o, s in zip(offset, box_shape))
                values = flat_index[index].flatten().tolist() if shape else [0]
                assert values == list(range(flat_start, flat_start + prod(box_shape)))
                covered += values
            assert covered == list(range(start, stop))
            assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_sharded_tensor_boxes_are_in_global_coordinates_with_prepended_axes():
    data = torch.arange(4.0)
    flat = ShardedTensor.from_rank_offsets_flat(
        "w", data, (2, 3), (0, 2, 3), (2, 1, 2), prepend_axis_num=1, flattened_range=slice(2, 6)
    )
    boxes = sharded_tensor_boxes(flat)
    assert [(box.offset, box.shape, sl) for box, sl in boxes] == [
        ((2, 0, 5), (1, 1, 1), slice(0, 1)),  # element (0, 2) of the piece at (layer 2, column 3)
        ((2, 1, 3), (1, 1, 3), slice(1, 4)),  # row 1 of the piece
    ]
    view = box_view(data, *boxes[1])
    view.fill_(7)
    assert data.tolist() == [0, 7, 7, 7]


def test_box_intersection():
    assert Box((0, 0), (4, 4)).intersection(Box((2, 3), (5, 5))) == Box((2, 3), (2, 1))
    assert Box((0, 0), (2, 2)).intersection(Box((2, 0), (2, 2))) is None
