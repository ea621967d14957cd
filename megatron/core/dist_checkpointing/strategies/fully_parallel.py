"""Fully parallel save: spread the writing of replicated pieces over the ranks that hold them.

Without it, the main replica (replica_id 0) of every piece writes it, so with data parallelism DP rank 0 writes the
whole model while the other DP ranks idle. The wrapper exchanges, within ``parallelization_group`` (typically the
data-parallel group), which pieces each rank holds, and re-chooses the writer of each piece whose main replica is in
the group among the group's ranks that hold it -- largest pieces first, each to the holder with the fewest bytes so
far -- so every piece is still written exactly once and each rank writes about 1/DP of the replicated bytes. The
choice is deterministic, so every rank computes the same one from the same exchanged list.
"""

from dataclasses import replace
from pathlib import Path
from typing import Dict, Hashable, List, Optional, Tuple

from torch.distributed import ProcessGroup

from ..dict_utils import dict_list_map_inplace, nested_values
from ..exchange import all_gather_objects, get_rank
from ..mapping import ShardedStateDict, ShardedTensor, is_main_replica
from .base import AsyncSaveShardedStrategy
from .torch import TorchDistSaveShardedStrategy

ShardId = Tuple[str, Tuple[int, ...], Tuple[int, int]]


def _shard_id(sh_ten: ShardedTensor) -> ShardId:
    flat = sh_ten.flattened_range
    return (sh_ten.key, tuple(sh_ten.global_offset), (-1, -1) if flat is None else (flat.start, flat.stop))


def _shard_bytes(sh_ten: ShardedTensor) -> int:
    return sh_ten.data.numel() * sh_ten.data.element_size()


def distribute_shards_to_ranks(
    holders: Dict[Hashable, List[int]], sizes: Dict[Hashable, int]
) -> Dict[Hashable, int]:
    """Choose one writer per shard among its ``holders``: largest shards first, each to the least-loaded holder
    (ties to the lowest rank)."""
    load: Dict[int, int] = {}
    writers = {}
    for shard in sorted(holders, key=lambda s: (-sizes[s], s)):
        writer = min(holders[shard], key=lambda r: (load.get(r, 0), r))
        writers[shard] = writer
        load[writer] = load.get(writer, 0) + sizes[shard]
    return writers


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Wraps a save strategy so that replicated ShardedTensors are written by all their holders in
    ``parallelization_group`` (None: all ranks) instead of by replica 0 alone. With ``do_cache_distribution`` the
    choice made at the first save is reused (the state dict structure must then stay the same)."""

    def __init__(
        self,
        strategy: TorchDistSaveShardedStrategy,
        parallelization_group: Optional[ProcessGroup] = None,
        do_cache_distribution: bool = False,
        backend: str = "torch_dist",
        version: int = 1,
    ):
        super().__init__(backend, version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_writers: Optional[Dict[ShardId, int]] = None

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, async_strategy: str = "nvrx"
    ):
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir, async_strategy)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        self.apply_saving_parallelization(sharded_state_dict)
        self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Collective over the group: replace, in place, each ShardedTensor leaf by a copy whose replica_id is 0 on
        the rank chosen to write it and 1 on the other holders."""
        writers = self.cached_writers if self.do_cache_distribution else None
        if writers is None:
            writers = self._choose_writers(sharded_state_dict)
            self.cached_writers = writers
        my_rank = get_rank(self.parallelization_group)

        def reassign(leaf):
            if not isinstance(leaf, ShardedTensor) or _shard_id(leaf) not in writers:
                return leaf
            return replace(leaf, replica_id=0 if writers[_shard_id(leaf)] == my_rank else 1)

        dict_list_map_inplace(reassign, sharded_state_dict)

    def _choose_writers(self, sharded_state_dict: ShardedStateDict) -> Dict[ShardId, int]:
        local = [
            (_shard_id(leaf), _shard_bytes(leaf), is_main_replica(leaf.replica_id))
            for leaf in nested_values(sharded_state_dict)
            if isinstance(leaf, ShardedTensor)
        ]
        holders: Dict[ShardId, List[int]] = {}
        sizes: Dict[ShardId, int] = {}
        has_main_in_group = set()
        for group_rank, shards in enumerate(all_gather_objects(local, group=self.parallelization_group)):
            for shard, size, is_main in shards:
                holders.setdefault(shard, []).append(group_rank)
                sizes[shard] = size
                if is_main:
                    has_main_in_group.add(shard)
        # A piece whose main replica lives in another group is written there; here nobody writes it.
        candidates = {shard: ranks for shard, ranks in holders.items() if shard in has_main_in_group}
        return distribute_shards_to_ranks(candidates, sizes)
