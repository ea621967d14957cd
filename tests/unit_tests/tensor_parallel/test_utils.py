"""Tensor splitting helpers and vocabulary ranges."""

import pytest
import torch

from megatron.core.tensor_parallel import (
    VocabUtility,
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)
from tests.unit_tests.tensor_parallel.common import tp_rank
from tests.unit_tests.test_utilities import Utils, run_distributed


def test_split_along_last_dim_gives_views_or_contiguous_copies():
    tensor = torch.arange(24.0).view(2, 3, 4)
    views = split_tensor_along_last_dim(tensor, 2)
    assert [tuple(v.shape) for v in views] == [(2, 3, 2), (2, 3, 2)]
    assert torch.equal(torch.cat(views, dim=-1), tensor)
    assert views[0].data_ptr() == tensor.data_ptr() and not views[1].is_contiguous()
    copies = split_tensor_along_last_dim(tensor, 2, contiguous_split_chunks=True)
    assert all(c.is_contiguous() for c in copies) and torch.equal(copies[1], views[1])
    with pytest.raises(ValueError, match="4 is not divisible by 3"):
        split_tensor_along_last_dim(tensor, 3)


def test_vocab_ranges():
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(8, rank=2, world_size=4) == (16, 24)
    assert VocabUtility.vocab_range_from_global_vocab_size(32, rank=3, world_size=4) == (24, 32)
    with pytest.raises(
        ValueError,
        match=r"vocabulary size 30 is not divisible by the tensor-parallel size 4; pad "
        r"it \(Megatron pads to a multiple of make_vocab_size_divisible_by \* "
        r"tensor_model_parallel_size\)",
    ):
        VocabUtility.vocab_range_from_global_vocab_size(30, rank=0, world_size=4)


def test_1d_chunks_without_groups_are_the_whole_tensor():
    tensor = torch.arange(6.0).view(2, 3)
    chunk = split_tensor_into_1d_equal_chunks(tensor)
    assert torch.equal(chunk, tensor.view(-1)) and chunk.data_ptr() == tensor.data_ptr()
    copy = split_tensor_into_1d_equal_chunks(tensor, new_buffer=True)
    assert torch.equal(copy, chunk) and copy.data_ptr() != tensor.data_ptr()
    assert torch.equal(gather_split_1d_tensor(chunk), tensor.view(-1))


def _split_and_gather_1d(tp):
    Utils.initialize_model_parallel(tp)
    tensor = torch.arange(24.0).view(2, 3, 4)
    chunk = split_tensor_into_1d_equal_chunks(tensor, new_buffer=True)
    per_rank = 24 // tp
    assert torch.equal(chunk, torch.arange(tp_rank() * per_rank, (tp_rank() + 1) * per_rank, dtype=torch.float32))
    assert torch.equal(gather_split_1d_tensor(chunk).view(2, 3, 4), tensor)
    with pytest.raises(
        ValueError,
        match=rf"cannot split a tensor of 5 elements \(shape \(5,\)\) into {tp} equal "
        "tensor-parallel chunks",
    ):
        split_tensor_into_1d_equal_chunks(torch.ones(5))
    return True


def test_1d_chunks_round_trip_over_the_tp_group():
    assert run_distributed(4, _split_and_gather_1d, 4) == [True] * 4
