"""Checks on sharded state dicts and checkpoints: do the ranks' pieces tile every tensor exactly once, do the requested
keys match the checkpoint's (with Megatron's strictness modes), are the checkpoint's files those its save wrote."""

import hashlib
import json
import logging
import os
from collections import defaultdict
from enum import Enum
from math import prod
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from torch.distributed import ProcessGroup

from .boxes import Box, sharded_tensor_boxes
from .checksums import load_verified_config
from .core import CONFIG_FNAME, CheckpointingConfig, CheckpointingException
from .dict_utils import diff, extract_matching_values, nested_values
from .exchange import all_gather_objects, get_rank
from .mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica

logger = logging.getLogger(__name__)

# Per rank, the data-less ShardedTensors/ShardedObjects it saves or loads.
LocalMetadata = List[Union[ShardedTensor, ShardedObject]]
GlobalMetadata = List[LocalMetadata]
# What load_sharded_metadata returns: {key: data-less ShardedTensor or ShardedObject}.
CkptShardedMetadata = Dict[str, Union[ShardedTensor, ShardedObject]]


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
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
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


def validate_sharding_integrity(global_metadata: GlobalMetadata, common_state_dict: Dict[str, Any] = None) -> None:
    """Raise unless, for every key, all ranks agree on its kind, global shape and dtype, and the main replicas
    (replica_id 0) of its pieces cover it exactly once. With ``common_state_dict`` (then a collective) rank 0 also
    warns about common-state values that differ between ranks (rank 0's copy is the one saved)."""
    if common_state_dict is not None:
        gathered = all_gather_objects(common_state_dict)
        if get_rank() == 0:
            warn_about_common_differences(gathered)
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
            f"ShardedObject {key!r} of global shape {tuple(first.global_shape)} misses shards {missing[:8]}: {reason}"
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
        parts.append(f"keys in the checkpoint that no rank requested (missing): {sorted(missing_keys)}")
    for rank, keys in sorted(unexpected_keys_by_rank.items()):
        if keys:
            parts.append(f"keys requested by rank {rank} that are not in the checkpoint (unexpected): {sorted(keys)}")
    return "; ".join(parts)


def warn_about_common_differences(common_state_dicts: List[Dict[str, Any]]) -> None:
    """Log, for each rank whose common state differs from rank 0's, which keys differ."""
    reference = common_state_dicts[0]
    for rank, other in enumerate(common_state_dicts[1:], start=1):
        only_rank0, only_other, mismatched = diff(reference, other)
        if only_rank0 or only_other or mismatched:
            logger.warning(
                "the common state of rank %d differs from rank 0's, which is the one saved: only on rank 0 %s, "
                "only on rank %d %s, different values %s",
                rank,
                only_rank0,
                rank,
                only_other,
                mismatched,
            )


def _local_metadata(sharded_state_dict: Dict[str, Any]) -> LocalMetadata:
    # Any leaf that can drop its data is a shard (ShardedBase or a stand-in with the same interface); plain values
    # (the common state) are not exchanged.
    return [leaf.without_data() for leaf in nested_values(sharded_state_dict) if hasattr(leaf, "without_data")]


def determine_global_metadata(
    sharded_state_dict: Dict[str, Any], process_group: Optional[ProcessGroup] = None
) -> Tuple[LocalMetadata, GlobalMetadata]:
    """Collective over ``process_group``: (this rank's data-less shards, every rank's)."""
    local_metadata = _local_metadata(sharded_state_dict)
    return local_metadata, all_gather_objects(local_metadata, process_group)


def adjust_non_strict_load(sharded_state_dict: Dict[str, Any], sharded_keys_to_remove: Set[str]) -> Dict[str, Any]:
    """``sharded_state_dict`` without the shards whose key is in ``sharded_keys_to_remove`` (they are not loaded)."""
    _, kept = extract_matching_values(
        sharded_state_dict, lambda leaf: isinstance(leaf, ShardedBase) and leaf.key in sharded_keys_to_remove
    )
    return kept


def maybe_report_missing_and_unexpected_keys(
    missing_keys: Set[str], unexpected_keys: Set[str], raise_error: bool = True
) -> None:
    """Raise a CheckpointingException (or, with ``raise_error=False``, log a warning) describing the mismatch;
    nothing when both sets are empty."""
    message = mismatch_message(missing_keys, {get_rank(): unexpected_keys})
    if not message:
        return
    if raise_error:
        raise CheckpointingException(f"the load request does not match the checkpoint: {message}")
    logger.warning("skipping mismatched keys: %s", message)


def validate_integrity_and_strict_load(
    sharded_state_dict: Dict[str, Any],
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: Optional[LocalMetadata] = None,
    global_metadata: Optional[GlobalMetadata] = None,
    ckpt_sharded_metadata: Optional["CkptShardedMetadata"] = None,
) -> Tuple[Dict[str, Any], Set[str], Set[str]]:
    """Apply ``strict`` to a load request: returns (the request without the unexpected keys unless a RAISE mode
    raised, missing keys, unexpected keys). ``ckpt_sharded_metadata`` (what :func:`load_sharded_metadata` returns)
    is needed by every mode but ASSUME_OK_UNEXPECTED; the global metadata is gathered when a mode or
    ``validate_access_integrity`` needs it and it is not given (a collective then)."""
    missing_keys, unexpected_keys = set(), set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException(f"strict={strict.value!r} needs the checkpoint's sharded metadata")
        if local_metadata is None:
            local_metadata = _local_metadata(sharded_state_dict)
        checkpoint_keys = {shard.key for shard in ckpt_sharded_metadata.values()}
        local_keys = {shard.key for shard in local_metadata}
        global_keys = checkpoint_keys
        if StrictHandling.requires_global_app_metadata(strict):
            if global_metadata is None:
                _, global_metadata = determine_global_metadata(sharded_state_dict)
            global_keys = {shard.key for shards in global_metadata for shard in shards}
        missing_keys, unexpected_keys = determine_missing_and_unexpected_keys(checkpoint_keys, local_keys, global_keys)
        if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.LOG_UNEXPECTED, StrictHandling.RETURN_UNEXPECTED):
            missing_keys = set()
        if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, raise_error=True)
        if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, raise_error=False)
        if unexpected_keys:
            sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected_keys)
        if strict == StrictHandling.IGNORE_ALL:
            missing_keys, unexpected_keys = set(), set()
    if validate_access_integrity:
        if global_metadata is None:
            _, global_metadata = determine_global_metadata(sharded_state_dict)
        validate_sharding_integrity(global_metadata)
    return sharded_state_dict, missing_keys, unexpected_keys


def verify_checkpoint(checkpoint_dir: str) -> CheckpointingConfig:
    """The config of ``checkpoint_dir``'s ``metadata.json``; raises unless it is a complete distributed
    checkpoint."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointingException(f"checkpoint directory {checkpoint_dir} does not exist")
    config = load_verified_config(checkpoint_dir)
    if config is None:
        raise CheckpointingException(
            f"{checkpoint_dir} is not a distributed checkpoint: {CONFIG_FNAME} is missing (the save did not finish, "
            "or the directory holds another format)"
        )
    return config


# The integrity manifest, in Megatron-Core's format: {"algorithm": "sha256", "files": {name: hex digest}} covering
# every other file of the checkpoint directory.
INTEGRITY_FNAME = "integrity.json"
_HASH_ALGORITHM = "sha256"
# Written by earlier versions of this project ({name: {"size": .., "sha256": ..}}); still verified.
_LEGACY_INTEGRITY_FNAME = "integrity_manifest.json"


def _file_digests(checkpoint_dir: Path) -> Dict[str, str]:
    digests = {}
    for path in sorted(checkpoint_dir.iterdir()):
        if not path.is_file() or path.name in (INTEGRITY_FNAME, _LEGACY_INTEGRITY_FNAME):
            continue
        sha = hashlib.sha256()
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                sha.update(block)
        digests[path.name] = sha.hexdigest()
    return digests


def save_integrity_manifest(checkpoint_dir: str) -> None:
    """Write ``integrity.json``: the SHA-256 of each of ``checkpoint_dir``'s files (one rank, after every file is
    written)."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / INTEGRITY_FNAME
    payload = {"algorithm": _HASH_ALGORITHM, "files": _file_digests(checkpoint_dir)}
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as file:
        json.dump(payload, file, indent=2)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _expected_digests(checkpoint_dir: Path) -> Dict[str, str]:
    path = checkpoint_dir / INTEGRITY_FNAME
    legacy = checkpoint_dir / _LEGACY_INTEGRITY_FNAME
    if not path.exists() and legacy.exists():
        path = legacy
    if not path.exists():
        raise CheckpointingException(
            f"{checkpoint_dir / INTEGRITY_FNAME} is missing: the checkpoint was saved without verify_integrity=True, "
            "so it cannot be verified"
        )
    try:
        with open(path) as file:
            manifest = json.load(file)
    except ValueError as error:
        raise CheckpointingException(f"{path} is not valid JSON ({error})") from error
    if path == legacy:
        return {name: entry["sha256"] for name, entry in manifest.items()}
    algorithm = manifest.get("algorithm", _HASH_ALGORITHM)
    if algorithm != _HASH_ALGORITHM:
        raise CheckpointingException(f"{path} uses hash algorithm {algorithm!r}; only {_HASH_ALGORITHM!r} is supported")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointingException(f'{path} has no "files" mapping of file names to SHA-256 digests')
    return manifest["files"]


def verify_integrity_manifest(checkpoint_dir: str) -> None:
    """Raise, naming the files, unless every file ``checkpoint_dir``'s manifest lists exists with the same SHA-256
    digest."""
    checkpoint_dir = Path(checkpoint_dir)
    expected = _expected_digests(checkpoint_dir)
    actual = _file_digests(checkpoint_dir)
    problems = [f"{name} is missing" for name in sorted(expected.keys() - actual.keys())]
    problems += [
        f"{name} differs (sha256 {actual[name][:16]}..., expected {expected[name][:16]}...)"
        for name in sorted(expected.keys() & actual.keys())
        if actual[name] != expected[name]
    ]
    if problems:
        raise CheckpointingException(
            f"the checkpoint {checkpoint_dir} does not match its integrity manifest: {'; '.join(problems)}"
        )
