"""Checks on sharded state dicts: do the ranks' pieces tile every tensor exactly once, and do the requested keys
match the checkpoint's (with Megatron's strictness modes)."""

import logging
from collections import defaultdict
from enum import Enum
from math import prod
from typing import Dict, List, Set, Tuple, Union

from .boxes import Box, sharded_tensor_boxes
from .core import CheckpointingException
from .mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica

logger = logging.getLogger(__name__)

# Per rank, the data-less ShardedTensors/ShardedObjects it saves or loads.
GlobalMetadata = List[List[ShardedBase]]


class StrictHandling(Enum):
    """What ``load`` does when the requested keys and the checkpoint's keys differ.

    *Unexpected* keys are requested by this rank but absent from the checkpoint; *missing* keys are in the checkpoint
    but requested by no rank. The ``*_UNEXPECTED`` modes look only at unexpected keys; the ``*_ALL`` modes at both.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"  # no check up front; an unexpected key fails the load
    LOG_UNEXPECTED = "log_unexpected"  # warn about unexpected keys and skip them
    LOG_ALL = "log_all"  # warn about unexpected and missing keys; skip the unexpected ones
    RAISE_UNEXPECTED = "raise_unexpected"  # raise before reading anything if any key is unexpected
    RAISE_ALL = "raise_all"  # raise before reading anything on any mismatch
    RETURN_UNEXPECTED = "return_unexpected"  # skip them; load returns (state_dict, missing=set(), unexpected)
    RETURN_ALL = "return_all"  # skip them; load returns (state_dict, missing, unexpected)
    IGNORE_ALL = "ignore_all"  # skip unexpected keys silently

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        return val in (
            StrictHandling.IGNORE_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL, StrictHandling.LOG_ALL
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """A StrictHandling from itself or its string value (the ``--dist-ckpt-strictness`` choices)."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError:
        choices = ", ".join(repr(mode.value) for mode in StrictHandling)
        raise ValueError(f"strict={strict!r} is not a strictness mode; choose one of {choices}") from None


def validate_sharding_integrity(global_metadata: GlobalMetadata) -> None:
    """Raise unless, for every key, all ranks agree on its kind, global shape and dtype, and the main replicas
    (replica_id 0) of its pieces cover it exactly once."""
    by_key: Dict[str, List[Tuple[int, ShardedBase]]] = defaultdict(list)
    for rank, shards in enumerate(global_metadata):
        for shard in shards:
            by_key[shard.key].append((rank, shard))
    for key, shards in by_key.items():
        kinds = {type(shard).__name__ for _, shard in shards}
        if len(kinds) > 1:
            raise CheckpointingException(f"key {key!r} is used by both {' and '.join(sorted(kinds))}")
        if isinstance(shards[0][1], ShardedTensor):
            _validate_tensor_key(key, shards)
        else:
            _validate_object_key(key, shards)


def _describe(rank: int, shard: ShardedTensor) -> str:
    where = f"offset {tuple(shard.global_offset)} shape {tuple(shard.local_shape)}"
    if shard.flattened_range is not None:
        where += f" flattened_range [{shard.flattened_range.start}, {shard.flattened_range.stop})"
    return f"{where} on rank {rank}"


def _validate_tensor_key(key: str, shards: List[Tuple[int, ShardedTensor]]) -> None:
    first_rank, first = shards[0]
    for rank, shard in shards[1:]:
        if tuple(shard.global_shape) != tuple(first.global_shape):
            raise CheckpointingException(
                f"ShardedTensor {key!r} has global shape {tuple(first.global_shape)} on rank {first_rank} but "
                f"{tuple(shard.global_shape)} on rank {rank}"
            )
        if shard.dtype != first.dtype:
            raise CheckpointingException(
                f"ShardedTensor {key!r} has dtype {first.dtype} on rank {first_rank} but {shard.dtype} on rank {rank}"
            )
    main = [(rank, shard) for rank, shard in shards if is_main_replica(shard.replica_id)]
    if not main:
        raise CheckpointingException(
            f"ShardedTensor {key!r} has no main replica (replica_id 0) on any rank, so nobody would save it"
        )
    pieces = [(box, rank, shard) for rank, shard in main for box, _ in sharded_tensor_boxes(shard)]
    _check_no_overlap(key, pieces)
    covered = sum(box.numel for box, _, _ in pieces)
    total = prod(first.global_shape)
    if covered != total:
        described = "; ".join(_describe(rank, shard) for rank, shard in main[:8])
        more = f" (and {len(main) - 8} more)" if len(main) > 8 else ""
        raise CheckpointingException(
            f"ShardedTensor {key!r}: the main replicas cover {covered} of the {total} elements of global shape "
            f"{tuple(first.global_shape)}; pieces are missing. Main replicas: {described}{more}. Check the rank "
            "offsets and that exactly one copy of each piece has replica_id 0"
        )


def _check_no_overlap(key: str, pieces: List[Tuple[Box, int, ShardedTensor]]) -> None:
    """Sweep along axis 0 so that only pieces sharing an axis-0 interval are compared (e.g. the same layer)."""
    if not pieces or not pieces[0][0].shape:
        if len(pieces) > 1:
            rank_a, rank_b = pieces[0][1], pieces[1][1]
            raise CheckpointingException(
                f"ShardedTensor {key!r}: the scalar has main replicas on ranks {rank_a} and {rank_b}; exactly one "
                "copy may have replica_id 0"
            )
        return
    ordered = sorted(pieces, key=lambda piece: piece[0].offset[0])
    active: List[Tuple[Box, int, ShardedTensor]] = []
    for piece in ordered:
        box = piece[0]
        active = [other for other in active if other[0].offset[0] + other[0].shape[0] > box.offset[0]]
        for other in active:
            if box.intersection(other[0]) is not None:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: main replicas overlap: {_describe(other[1], other[2])} and "
                    f"{_describe(piece[1], piece[2])}. Exactly one copy of each piece may have replica_id 0"
                )
        active.append(piece)


def _validate_object_key(key: str, shards: List[Tuple[int, ShardedObject]]) -> None:
    first_rank, first = shards[0]
    for rank, shard in shards[1:]:
        if tuple(shard.global_shape) != tuple(first.global_shape):
            raise CheckpointingException(
                f"ShardedObject {key!r} has global shape {tuple(first.global_shape)} on rank {first_rank} but "
                f"{tuple(shard.global_shape)} on rank {rank}"
            )
    owners: Dict[Tuple[int, ...], List[int]] = defaultdict(list)
    for rank, shard in shards:
        if is_main_replica(shard.replica_id):
            owners[tuple(shard.global_offset)].append(rank)
    duplicated = {offset: ranks for offset, ranks in owners.items() if len(ranks) > 1}
    if duplicated:
        offset, ranks = next(iter(duplicated.items()))
        raise CheckpointingException(
            f"ShardedObject {key!r} shard {offset} has main replicas on ranks {ranks}; exactly one copy may have "
            "replica_id 0"
        )
    expected = prod(first.global_shape)
    if len(owners) != expected:
        held = {tuple(shard.global_offset) for _, shard in shards}
        missing = [offset for offset in _grid(tuple(first.global_shape)) if offset not in owners]
        reason = "no rank holds them" if not set(missing) & held else "no copy of them has replica_id 0"
        raise CheckpointingException(
            f"ShardedObject {key!r} of global shape {tuple(first.global_shape)} misses shards {missing[:8]}: "
            f"{reason}"
        )


def _grid(shape: Tuple[int, ...]):
    if not shape:
        yield ()
        return
    for head in range(shape[0]):
        for tail in _grid(shape[1:]):
            yield (head,) + tail


def determine_missing_and_unexpected_keys(
    checkpoint_keys: Set[str], local_keys: Set[str], global_keys: Set[str]
) -> Tuple[Set[str], Set[str]]:
    """(missing: in the checkpoint but requested by no rank, unexpected: requested here but not in the checkpoint)."""
    return checkpoint_keys - global_keys, local_keys - checkpoint_keys


def mismatch_message(missing_keys: Set[str], unexpected_keys_by_rank: Dict[int, Set[str]]) -> str:
    """The report of key mismatches between a load request and a checkpoint."""
    parts = []
    if missing_keys:
        parts.append(
            f"keys in the checkpoint that no rank requested (missing): {sorted(missing_keys)}"
        )
    for rank, keys in sorted(unexpected_keys_by_rank.items()):
        if keys:
            parts.append(f"keys requested by rank {rank} that are not in the checkpoint (unexpected): {sorted(keys)}")
    return "; ".join(parts)
