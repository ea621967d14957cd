"""Fully parallel save: each replicated piece is written exactly once, by one of the ranks that hold it, and the
bytes are spread over them. Who wrote what is read back from the DCP metadata (``__<rank>_<n>.distcp``).
Fully parallel load: each piece several ranks ask for is read from disk once and shared."""

import re
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, load, load_plain_tensors, save
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    distribute_shards_to_ranks,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from tests.unit_tests.test_utilities import run_distributed

SIZES = [64, 48, 40, 32, 16, 8, 8, 4]  # rows of 16 floats


def _replicated(key_index, replica_id):
    value = torch.full((SIZES[key_index], 16), float(key_index))
    return ShardedTensor.from_rank_offsets(f"t{key_index}", value, replica_id=replica_id)


def _writers(checkpoint_dir):
    """{(key, offset): writing rank} and {rank: bytes written} of the tensors (not the common_state object)."""
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    writers, written = {}, defaultdict(int)
    for index, info in metadata.storage_data.items():
        if index.offset is None:
            continue
        rank = int(re.match(r"__(\d+)_", info.relative_path).group(1))
        writers[(index.fqn, tuple(index.offset))] = rank
        entry = metadata.state_dict_metadata[index.fqn]
        written[rank] += next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset)).sizes.numel() * 4
    return writers, dict(written)


def _save_replicated(checkpoint_dir, fully_parallel):
    rank = dist.get_rank()
    state = {f"t{i}": _replicated(i, replica_id=rank) for i in range(len(SIZES))}
    strategy = get_default_save_sharded_strategy()
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy)
    save(state, checkpoint_dir, sharded_strategy=strategy)
    # The caller's state dict keeps its replica ids: the wrapper works on save()'s copy.
    return [state[f"t{i}"].replica_id for i in range(len(SIZES))]


def test_replicated_pieces_are_spread_over_data_parallel_ranks(tmp_path):
    plain_dir, parallel_dir = tmp_path / "plain", tmp_path / "parallel"
    plain_dir.mkdir(), parallel_dir.mkdir()
    run_distributed(4, _save_replicated, str(plain_dir), False)
    replica_ids = run_distributed(4, _save_replicated, str(parallel_dir), True)
    assert replica_ids == [[rank] * len(SIZES) for rank in range(4)]

    plain_writers, plain_bytes = _writers(plain_dir)
    assert set(plain_writers.values()) == {0}  # without the wrapper replica 0 writes everything

    writers, written = _writers(parallel_dir)
    assert len(writers) == len(SIZES)  # every piece once
    assert set(writers.values()) == {0, 1, 2, 3}
    total = sum(SIZES) * 16 * 4
    assert sum(written.values()) == total and max(written.values()) <= total / 4 + max(SIZES) * 16 * 4
    for key, value in load_plain_tensors(parallel_dir).items():
        assert torch.equal(value, torch.full((SIZES[int(key[1:])], 16), float(key[1:])))


def _save_tp2_dp2(checkpoint_dir):
    """Ranks (tp, dp) = (r % 2, r // 2). DP groups {0, 2} and {1, 3} parallelise the save. Column pieces are split
    by TP and replicated over DP; the norm is replicated everywhere with its main replica on rank 0."""
    rank = dist.get_rank()
    tp, dp = rank % 2, rank // 2
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    state = {
        f"col{i}": ShardedTensor.from_rank_offsets(
            f"col{i}", torch.full((8 * (i + 1), 4), float(i)), (1, tp, 2), replica_id=(0, dp)
        )
        for i in range(4)
    }
    state["norm"] = ShardedTensor.from_rank_offsets("norm", torch.ones(32), replica_id=(tp, dp))
    wrapper = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), groups[tp])
    save(state, checkpoint_dir, sharded_strategy=wrapper)
    return True


def test_the_parallelization_group_limits_who_may_write(tmp_path):
    run_distributed(4, _save_tp2_dp2, str(tmp_path))
    writers, _ = _writers(tmp_path)
    assert writers[("norm", (0,))] in (0, 2)  # only the DP group holding the main replica writes it
    for (key, offset), rank in writers.items():
        if key.startswith("col"):
            tp = offset[1] // 4
            assert rank % 2 == tp, (key, offset, rank)
    assert {rank // 2 for key, rank in writers.items()} == {0, 1}  # both DP ranks of a group write something


def test_distribution_is_greedy_by_size_and_deterministic():
    holders = {"a": [0, 1], "b": [0, 1], "c": [0, 1], "d": [1]}
    sizes = {"a": 10, "b": 6, "c": 5, "d": 1}
    assert distribute_shards_to_ranks(holders, sizes) == {"a": 0, "b": 1, "c": 1, "d": 1}


# ---- fully parallel load --------------------------------------------------------------------------------------


class _RecordingLoadStrategy(TorchDistLoadShardedStrategy):
    """Remembers which pieces this rank read from disk (but the common state, which every rank reads)."""

    def __init__(self):
        super().__init__()
        self.read = []

    def load_local(self, sharded_state_dict, checkpoint_dir):
        self.read += [leaf.key for leaf in nested_values(sharded_state_dict) if leaf.key != "common_state"]
        return super().load_local(sharded_state_dict, checkpoint_dir)


def _request(rank, with_data):
    """Every rank asks for all the replicated pieces (some with a buffer to fill, some without), a piece only it
    holds, a flattened piece and the replicated RNG-like object."""
    state = {}
    for i in range(len(SIZES)):
        piece = _replicated(i, replica_id=rank)
        state[f"t{i}"] = piece if with_data and i % 2 else piece.without_data()
    own = ShardedTensor.from_rank_offsets("own", torch.zeros(2, 3), (0, rank, 4), replica_id=0)
    flat = ShardedTensor.from_rank_offsets_flat(
        "t0", torch.zeros(10), (SIZES[0], 16), flattened_range=slice(5, 15), replica_id=rank + 1
    )
    return {**state, "own": own, "flat": [flat], "rng": ShardedObject("rng", None, (1,), (0,), replica_id=rank)}


def _load_fully_parallel(checkpoint_dir):
    rank = dist.get_rank()
    state = {f"t{i}": _replicated(i, replica_id=rank) for i in range(len(SIZES))}
    state["own"] = ShardedTensor.from_rank_offsets("own", torch.full((2, 3), float(rank)), (0, rank, 4))
    state["rng"] = ShardedObject("rng", {"seed": 11}, (1,), (0,), replica_id=rank)
    save(state, checkpoint_dir)
    base = _RecordingLoadStrategy()
    wrapper = FullyParallelLoadStrategyWrapper(base, do_cache_distribution=True)
    request = _request(rank, with_data=True)
    loaded = load(request, checkpoint_dir, sharded_strategy=wrapper)
    first_reads = list(base.read)
    base.read.clear()
    again = load(_request(rank, with_data=False), checkpoint_dir, sharded_strategy=wrapper)  # cached distribution
    filled_in_place = all(loaded[f"t{i}"] is request[f"t{i}"].data for i in range(1, len(SIZES), 2))
    values = {
        "t": [
            loaded[f"t{i}"].tolist() == again[f"t{i}"].tolist() == [[float(i)] * 16] * SIZES[i]
            for i in range(len(SIZES))
        ],
        "own": loaded["own"].tolist() == [[float(rank)] * 3] * 2,
        "flat": loaded["flat"][0].tolist() == [0.0] * 10,
        "rng": (loaded["rng"], again["rng"]),
    }
    return values, filled_in_place, first_reads, sorted(base.read) == sorted(first_reads)


def test_fully_parallel_load_reads_each_replicated_piece_once_and_shares_it(tmp_path):
    results = run_distributed(4, _load_fully_parallel, str(tmp_path))
    reads = [first for _, _, first, _ in results]
    for rank, (values, filled_in_place, _, same_reads_when_cached) in enumerate(results):
        assert all(values["t"]) and values["own"] and values["flat"], f"rank {rank}: wrong values"
        assert values["rng"] == ({"seed": 11}, {"seed": 11})
        assert filled_in_place and same_reads_when_cached
        assert "own" in reads[rank]  # a piece only this rank asked for is read here
    shared = [key for rank_reads in reads for key in rank_reads if key != "own"]
    assert sorted(shared) == sorted([f"t{i}" for i in range(len(SIZES))] + ["t0", "rng"])  # each piece read once
    assert all(len(rank_reads) < len(SIZES) for rank_reads in reads)  # the reading is spread over the ranks


def test_fully_parallel_load_helpers():
    piece = ShardedTensor.from_rank_offsets("a", torch.zeros(2))
    state = {"a": piece, "o": [ShardedObject("o", None, (2,), (1,))]}
    FullyParallelLoadStrategyWrapper.fill_in_deferred_sharded_tensors(state, {("a", (0,), None): torch.ones(2)})
    FullyParallelLoadStrategyWrapper.fill_in_deferred_sharded_objects(state, {("o", (1,), None): "x"})
    assert state["a"].tolist() == [1.0, 1.0] and state["o"] == ["x"]
    with pytest.raises(ValueError, match="not supported yet: exchange_algo='gather_rounds'"):
        FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo="gather_rounds")
