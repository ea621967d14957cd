"""Fully parallel save and load: spread the writing and the reading of replicated pieces over the ranks that hold
them.

Without it, the main replica (replica_id 0) of every piece writes it, so with data parallelism DP rank 0 writes the
whole model while the other DP ranks idle. The wrapper exchanges, within ``parallelization_group`` (typically the
data-parallel group), which pieces each rank holds, and re-chooses the writer of each piece whose main replica is in
the group among the group's ranks that hold it -- largest pieces first, each to the holder with the fewest bytes so
far -- so every piece is still written exactly once and each rank writes about 1/DP of the replicated bytes. The
choice is deterministic, so every rank computes the same one from the same exchanged list.
"""

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Hashable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..dict_utils import dict_list_map_inplace, dict_list_map_outplace, nested_values
from ..exchange import all_gather_objects, collective_device, get_rank
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from .base import AsyncSaveShardedStrategy, LoadShardedStrategy
from .torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    check_async_strategy,
)

# (key, global offset, flattened range as (start, stop) or None): one piece of a ShardedTensor or ShardedObject.
ShardId = Tuple[str, Tuple[int, ...], Optional[Tuple[int, int]]]


def _shard_id(shard: Union[ShardedTensor, ShardedObject]) -> ShardId:
    flat = getattr(shard, "flattened_range", None)
    return (shard.key, tuple(shard.global_offset), None if flat is None else (flat.start, flat.stop))


@dataclass
class ShardDistribution:
    """Which rank of the parallelization group handles each piece held by several of its ranks (for a save: writes
    it; for a load: reads it and sends it to the others), and the shape and dtype of each piece (None for
    objects) so that every rank can take part in its exchange."""

    main_rank_for_shard: Dict[ShardId, int]
    shard_to_metadata: Dict[ShardId, Optional[Tuple[Tuple[int, ...], torch.dtype]]] = field(default_factory=dict)


def _shard_bytes(sh_ten: ShardedTensor) -> int:
    return sh_ten.data.numel() * sh_ten.data.element_size()


def distribute_shards_to_ranks(holders: Dict[Hashable, List[int]], sizes: Dict[Hashable, int]) -> Dict[Hashable, int]:
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
        self.cached_distribution: Optional[ShardDistribution] = None

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, async_strategy: str = "nvrx"):
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir, async_strategy)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        self.apply_saving_parallelization(sharded_state_dict)
        self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Collective over the group: replace, in place, each ShardedTensor leaf by a copy whose replica_id is 0 on
        the rank chosen to write it and 1 on the other holders."""
        distribution = self.cached_distribution if self.do_cache_distribution else None
        if distribution is None:
            distribution = self._choose_writers(sharded_state_dict)
            self.cached_distribution = distribution
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, self.parallelization_group, distribution
        )

    def _choose_writers(self, sharded_state_dict: ShardedStateDict) -> ShardDistribution:
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
        return ShardDistribution(distribute_shards_to_ranks(candidates, sizes))


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: ProcessGroup,
    precomputed_distribution: Optional[ShardDistribution],
):
    """Make, in place, the rank that ``precomputed_distribution`` names for a ShardedTensor piece its main replica
    (replica_id 0) and the piece's other holders in the group non-main (1); pieces it does not name, or everything
    when it is None, keep their replica ids. No collective."""
    if precomputed_distribution is None:
        return
    writers = precomputed_distribution.main_rank_for_shard
    my_rank = get_rank(parallelization_group)

    def reassign(leaf):
        if not isinstance(leaf, ShardedTensor) or _shard_id(leaf) not in writers:
            return leaf
        return replace(leaf, replica_id=0 if writers[_shard_id(leaf)] == my_rank else 1)

    dict_list_map_inplace(reassign, sharded_state_dict)


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Wraps a load strategy so that a piece requested by several ranks of ``parallelization_group`` (typically
    the data-parallel replicas) is read from disk by one of them and sent to the others, instead of by each.

    The readers are chosen like the fully parallel save's writers (largest pieces first, each to the least loaded
    requester), so each rank reads about 1/N of the replicated bytes; the pieces then travel by broadcast within
    the group (``exchange_algo='broadcast'``, the only algorithm here). With ``do_cache_distribution`` the choice of
    the first load is reused (the requests must then keep their structure).
    """

    def __init__(
        self,
        strategy: TorchDistLoadShardedStrategy,
        parallelization_group: Optional[ProcessGroup] = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ):
        if exchange_algo != "broadcast":
            raise ValueError(f"FullyParallelLoadStrategyWrapper: not supported yet: exchange_algo={exchange_algo!r}")
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self.cached_distribution: Optional[ShardDistribution] = None

    @property
    def stream_ckpt_dequant(self):
        return self.base_strategy.stream_ckpt_dequant

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, async_strategy: str = "mcore"
    ) -> StateDict:
        """Collective over all ranks (the reads) and the group (the exchange): the request with every piece
        replaced by its loaded value."""
        check_async_strategy(async_strategy)
        distribution = self.apply_loading_parallelization(sharded_state_dict)
        readers = distribution.main_rank_for_shard
        my_rank = get_rank(self.parallelization_group)
        pieces = [
            leaf for leaf in nested_values(sharded_state_dict) if isinstance(leaf, (ShardedTensor, ShardedObject))
        ]
        mine = {_shard_id(leaf): leaf for leaf in pieces if readers.get(_shard_id(leaf), my_rank) == my_rank}
        # A flat request keyed by position: a loaded object may itself be a dict, so values are not matched by
        # walking nested structures.
        flat_request = {str(i): leaf for i, leaf in enumerate(mine.values())}
        flat_loaded = self.base_strategy.load(flat_request, checkpoint_dir)
        read_here = {shard: flat_loaded[str(i)] for i, shard in enumerate(mine)}
        wanted = {_shard_id(leaf): leaf for leaf in pieces if _shard_id(leaf) not in mine}
        tensors, objects = self._exchange(distribution, read_here, wanted)
        for shard, value in read_here.items():
            (objects if isinstance(mine[shard], ShardedObject) else tensors)[shard] = value
        result = dict_list_map_outplace(lambda leaf: leaf, sharded_state_dict)
        self.fill_in_deferred_sharded_tensors(result, tensors)
        self.fill_in_deferred_sharded_objects(result, objects)
        return result

    def apply_loading_parallelization(self, sharded_state_dict: ShardedStateDict) -> Optional[ShardDistribution]:
        """Collective over the group: choose, for every piece requested by several of its ranks, the one that reads
        it (every rank computes the same choice from the exchanged requests)."""
        if self.do_cache_distribution and self.cached_distribution is not None:
            return self.cached_distribution
        local = []
        for leaf in nested_values(sharded_state_dict):
            if isinstance(leaf, ShardedTensor):
                shape = _piece_shape(leaf)
                local.append((_shard_id(leaf), math.prod(shape) * leaf.dtype.itemsize, (shape, leaf.dtype)))
            elif isinstance(leaf, ShardedObject):
                local.append((_shard_id(leaf), 1, None))
        holders: Dict[ShardId, List[int]] = {}
        sizes: Dict[ShardId, int] = {}
        metadata: Dict[ShardId, Optional[Tuple[Tuple[int, ...], torch.dtype]]] = {}
        for group_rank, shards in enumerate(all_gather_objects(local, group=self.parallelization_group)):
            for shard, size, meta in shards:
                holders.setdefault(shard, []).append(group_rank)
                sizes[shard], metadata[shard] = size, meta
        shared = {shard: ranks for shard, ranks in holders.items() if len(ranks) > 1}
        distribution = ShardDistribution(
            distribute_shards_to_ranks(shared, sizes), {shard: metadata[shard] for shard in shared}
        )
        if self.do_cache_distribution:
            self.cached_distribution = distribution
        return distribution

    def _exchange(
        self, distribution: ShardDistribution, read_here: Dict[ShardId, Any], needed: Dict[ShardId, Any]
    ) -> Tuple[Dict[ShardId, torch.Tensor], Dict[ShardId, Any]]:
        """Every shared piece, broadcast by its reader to the whole group in the same order on every rank; returns
        the pieces in ``needed`` (this rank's requests read elsewhere)."""
        group = self.parallelization_group
        my_rank = get_rank(group)
        tensors: Dict[ShardId, torch.Tensor] = {}
        objects: Dict[ShardId, Any] = {}
        for shard in sorted(distribution.main_rank_for_shard, key=repr):
            reader = distribution.main_rank_for_shard[shard]
            source = dist.get_global_rank(group, reader) if group is not None else reader
            meta = distribution.shard_to_metadata[shard]
            if meta is None:
                box = [read_here.get(shard)]
                dist.broadcast_object_list(box, src=source, group=group)
                if shard in needed:
                    objects[shard] = box[0]
                continue
            shape, dtype = meta
            if reader == my_rank:
                buffer = read_here[shard].contiguous()
            else:
                buffer = torch.empty(shape, dtype=dtype, device=collective_device())
            dist.broadcast(buffer, src=source, group=group)
            if shard in needed:
                tensors[shard] = _into_request(needed[shard], buffer)
        return tensors, objects

    @staticmethod
    def fill_in_deferred_sharded_tensors(
        sharded_state_dict: ShardedStateDict, loaded_tensors: Dict[Tuple[str, tuple, Optional[tuple]], torch.Tensor]
    ) -> None:
        """Replace, in place, each ShardedTensor leaf by its entry in ``loaded_tensors`` (keyed by (key, global offset,
        flattened range)); leaves without an entry stay."""
        dict_list_map_inplace(
            lambda leaf: loaded_tensors.get(_shard_id(leaf), leaf) if isinstance(leaf, ShardedTensor) else leaf,
            sharded_state_dict,
        )

    @staticmethod
    def fill_in_deferred_sharded_objects(
        sharded_state_dict: ShardedStateDict, loaded_objects: Dict[Tuple[str, tuple, Optional[tuple]], Any]
    ) -> None:
        """Replace, in place, each ShardedObject leaf by its entry in ``loaded_objects`` (keyed by (key, global offset,
        None)); leaves without an entry stay."""
        dict_list_map_inplace(
            lambda leaf: loaded_objects.get(_shard_id(leaf), leaf) if isinstance(leaf, ShardedObject) else leaf,
            sharded_state_dict,
        )

    def load_local(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """The wrapped strategy's read on this rank alone, without sharing (e.g. the common state)."""
        return self.base_strategy.load_local(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Path):
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Path):
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)


def _piece_shape(shard: ShardedTensor) -> Tuple[int, ...]:
    flat = shard.flattened_range
    return tuple(shard.local_shape) if flat is None else (flat.stop - flat.start,)


def _into_request(shard: ShardedTensor, received: torch.Tensor) -> torch.Tensor:
    """The received piece in the request's own tensor when it has one (filled in place), else on the CPU."""
    if shard.data is None:
        return received.cpu()
    shard.data.copy_(received)
    return shard.data
