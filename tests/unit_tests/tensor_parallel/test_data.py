"""broadcast_data: TP rank 0's batch reaches every rank of its tensor-parallel group, and nobody else's."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import broadcast_data
from tests.unit_tests.tensor_parallel.common import tp_rank
from tests.unit_tests.test_utilities import Utils, run_distributed

KEYS = ("tokens", "labels", "loss_mask", "scalar")


def _batch(source_rank: int):
    """A batch whose values say which rank produced it; shapes from 0-D to 4-D."""
    base = 1000 * source_rank
    return {
        "tokens": torch.arange(12).view(3, 4) + base,
        "labels": torch.arange(5) + base,
        "loss_mask": torch.arange(24).view(2, 3, 2, 2) + base,
        "scalar": torch.tensor(base),
    }


def _broadcast_within_tp_groups(tp):
    Utils.initialize_model_parallel(tp)
    source = dist.get_rank() - tp_rank()  # global rank of this group's TP rank 0
    data = _batch(dist.get_rank()) if tp_rank() == 0 else None
    received = broadcast_data(list(KEYS), data, torch.int64)
    expected = _batch(source)
    assert list(received) == list(KEYS)
    for key in KEYS:
        assert received[key].dtype == torch.int64
        assert torch.equal(received[key], expected[key]), key
    return True


def test_broadcast_reaches_each_tp_group_from_its_own_rank_zero():
    # World of 4 with TP=2: groups {0, 1} and {2, 3} each get their own rank 0's batch.
    assert run_distributed(4, _broadcast_within_tp_groups, 2) == [True] * 4


def test_without_groups_the_data_comes_back():
    received = broadcast_data(["labels"], _batch(0), torch.int64)
    assert torch.equal(received["labels"], _batch(0)["labels"])


def test_dtype_must_match():
    with pytest.raises(
        TypeError,
        match=r"broadcast_data: 'tokens' has dtype torch.int64, expected torch.float32; "
        "cast it first",
    ):
        broadcast_data(["tokens"], _batch(0), torch.float32)


def test_key_must_be_present():
    with pytest.raises(KeyError, match=r"broadcast_data: key 'position_ids' is missing from data \(it has \["):
        broadcast_data(["position_ids"], _batch(0), torch.int64)


def test_at_most_five_dimensions():
    with pytest.raises(
        ValueError,
        match=r"broadcast_data: 'deep' has 6 dimensions \(shape \(1, 1, 1, 1, 1, 2\)\); "
        "at most 5 are supported",
    ):
        broadcast_data(["deep"], {"deep": torch.zeros(1, 1, 1, 1, 1, 2, dtype=torch.int64)}, torch.int64)
