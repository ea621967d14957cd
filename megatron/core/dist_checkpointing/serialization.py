"""Save and load sharded state dicts: the entry points of ``megatron.core.dist_checkpointing``.

A checkpoint directory holds the sharded data (``torch_dist``: DCP ``.distcp`` files and ``.metadata``) and,
written last, ``metadata.json`` naming the backend. As in Megatron-Core 0.19 the non-sharded ("common") state is
saved among the sharded data, as the ShardedObject ``common_state`` (see ``strategies/common.py``); a legacy
``common.pt`` is read instead when a checkpoint has one. ``metadata.json`` is the completion marker: a directory
without it is not a (complete) distributed checkpoint.

Every function here that takes part in collectives is called on all ranks; an error on any rank is raised on every
rank at the same point (see ``exchange.py``), so a bad request never leaves the other ranks hanging.
"""

import logging
from pathlib import Path
from typing import Callable, Dict, Optional, Set, Tuple, Union

from torch.distributed import ProcessGroup

from .checksums import remove_records, save_verified_config
from .core import CheckpointingConfig, CheckpointingException, CONFIG_FNAME
from .dict_utils import dict_list_map_outplace, extract_matching_values, merge, nested_values
from .exchange import all_gather_objects, describe_error, gather_and_raise_errors, get_rank, raise_gathered_errors
from .mapping import (
    CommonStateDict,
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from .strategies.common import (
    COMMON_STATE_FNAME,
    COMMON_STATE_KEY,
    TorchCommonLoadStrategy,
    common_state_sharded_object,
    has_legacy_common_state,
)
from .strategies.torch import (
    DCP_METADATA_FNAME,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    check_async_strategy,
)
from .validation import (
    StrictHandling,
    determine_missing_and_unexpected_keys,
    mismatch_message,
    parse_strict_flag,
    save_integrity_manifest,
    validate_sharding_integrity,
    verify_checkpoint,
    verify_integrity_manifest,
    warn_about_common_differences,
)

logger = logging.getLogger(__name__)

# Where save() puts the caller's content_metadata in the common state (Megatron's key).
CONTENT_METADATA_KEY = "content_metadata"


def get_default_save_sharded_strategy(backend: str = "torch_dist"):
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, 1)


def get_default_load_sharded_strategy(checkpoint_dir: str | Path | None = None):
    """The strategy that reads ``checkpoint_dir`` (checked to be a complete checkpoint), or the ``torch_dist``
    default when no directory is given."""
    if checkpoint_dir is None:
        return get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1)
    return verify_checkpoint_and_load_strategy(checkpoint_dir)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: TorchDistSaveShardedStrategy = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[CommonStateDict], StateDict]] = None,
    content_metadata: Optional[dict] = None,
    async_strategy: Optional[str] = "nvrx",
    verify_integrity: bool = False,
) -> Optional[AsyncRequest]:
    """Collective: save ``sharded_state_dict`` into the existing directory ``checkpoint_dir``.

    ShardedTensors and ShardedObjects are written by their main replicas (or spread over their holders with a
    :class:`FullyParallelSaveStrategyWrapper`); ShardedTensorFactories are built first; LocalNonpersistentObjects are
    dropped; every other value is the common state, saved from rank 0 as the ShardedObject ``common_state``
    (``content_metadata``, when given, is stored in it under ``"content_metadata"``; read it back with
    :func:`load_content_metadata`). With ``validate_access_integrity`` the ranks check together that the pieces of
    every tensor are covered exactly once, and rank 0 warns about common-state values that differ between ranks
    (after ``preprocess_common_before_consistancy_check``, which can drop values expected to differ). With
    ``async_sharded_save`` the data is staged (copied) and the returned :class:`AsyncRequest` does the writing
    (``async_strategy``: 'mcore', or 'nvrx', which falls back to 'mcore' here); schedule it on an
    ``AsyncCallsQueue``. ``metadata.json`` is written only after every rank's shards are on disk; with
    ``verify_integrity`` rank 0 then writes the integrity manifest that ``load(..., verify_integrity=True)`` checks.
    The caller's ``sharded_state_dict`` is not modified.
    """
    checkpoint_dir = Path(checkpoint_dir)
    sharded_strategy = _resolve_strategy(sharded_strategy, StrategyAction.SAVE_SHARDED, ("torch_dist", 1))
    if async_sharded_save and not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
        raise CheckpointingException(
            f"async_sharded_save needs an AsyncSaveShardedStrategy, got {type(sharded_strategy).__name__}"
        )
    rank = get_rank()
    local_error, shards, compared_common, sharded_part = None, [], None, {}
    # Errors are caught, not raised: every rank must still reach the all-gather below, or the others would hang.
    try:
        if async_sharded_save:
            check_async_strategy(async_strategy)
        sharded_part, common_state_dict = _split_for_save(sharded_state_dict)
        if content_metadata is not None:
            common_state_dict[CONTENT_METADATA_KEY] = content_metadata
        shards = list(nested_values(sharded_part))
        for shard in shards:
            _check_saveable(shard)
        if validate_access_integrity:
            compared_common = common_state_dict
            if preprocess_common_before_consistancy_check is not None:
                compared_common = preprocess_common_before_consistancy_check(common_state_dict)
        # Every rank adds it with replica_id=rank, so only rank 0's copy (the main replica) is written.
        common_object = common_state_sharded_object(common_state_dict, rank)
        shards.append(common_object)
        sharded_part = {"sharded": sharded_part, COMMON_STATE_KEY: common_object}
        # The all-gather below doubles as a barrier: no rank writes before the stale markers are gone.
        if rank == 0:
            _prepare_directory(checkpoint_dir)
    except Exception as error:
        local_error = error
    gathered = all_gather_objects(
        (
            None if local_error is None else describe_error(local_error),
            # Metadata only: the integrity check needs offsets and shapes, not the tensors.
            [shard.without_data() for shard in shards] if validate_access_integrity else None,
            compared_common,
        )
    )
    raise_gathered_errors([entry[0] for entry in gathered], f"saving checkpoint {checkpoint_dir}")
    if validate_access_integrity:
        validate_sharding_integrity([entry[1] for entry in gathered])
        if rank == 0:
            warn_about_common_differences([entry[2] for entry in gathered])

    config = CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version)

    def write_config() -> None:
        error = None
        if rank == 0:
            try:
                save_verified_config(config, checkpoint_dir)
                if verify_integrity:
                    save_integrity_manifest(str(checkpoint_dir))
            except Exception as caught:
                error = caught
        # Collective even though only rank 0 writes: a failure there must surface on every rank.
        gather_and_raise_errors(error, f"writing {checkpoint_dir / CONFIG_FNAME}")

    if async_sharded_save:
        request = sharded_strategy.async_save(sharded_part, checkpoint_dir, async_strategy)
        # metadata.json marks completion, so it is written only once every rank's async write is done.
        request.add_finalize_fn(write_config)
        return request
    sharded_strategy.save(sharded_part, checkpoint_dir)
    write_config()
    return None


def _resolve_strategy(strategy, action: StrategyAction, default: Tuple[str, int]):
    if strategy is None:
        return get_default_strategy(action, *default)
    if isinstance(strategy, tuple):
        return get_default_strategy(action, *strategy)
    return strategy


def _split_for_save(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, CommonStateDict]:
    """(the sharded leaves with factories built, the common state) -- on a copy of the caller's structure."""
    # A copy of the nesting (not the tensors), so building factories leaves the caller's dict as it was.
    structure = dict_list_map_outplace(lambda leaf: leaf, sharded_state_dict)
    apply_factories(structure)
    sharded_part, rest = extract_matching_values(structure, lambda leaf: isinstance(leaf, ShardedBase))
    # LocalNonpersistentObjects are rank-local by definition: they are dropped, not saved.
    _, common_state_dict = extract_matching_values(rest, lambda leaf: isinstance(leaf, LocalNonpersistentObject))
    return sharded_part, common_state_dict


def _check_saveable(shard: ShardedBase) -> None:
    if shard.key == COMMON_STATE_KEY:
        raise CheckpointingException(
            f"the key {COMMON_STATE_KEY!r} is reserved for the checkpoint's common state; rename that entry"
        )
    if not isinstance(shard, (ShardedTensor, ShardedObject)):
        raise CheckpointingException(f"cannot save {type(shard).__name__} {shard.key!r}")
    shard.validate_metadata_integrity()
    if isinstance(shard, ShardedTensor) and shard.data is None:
        raise CheckpointingException(f"ShardedTensor {shard.key!r} has no data to save")


def _prepare_directory(checkpoint_dir: Path) -> None:
    """Rank 0, before anyone writes: the directory must exist; completion markers of an older save in it are removed
    first, so a save interrupted from here on never leaves a directory that looks complete (and a legacy
    ``common.pt``, which loading would prefer to the new common state)."""
    if not checkpoint_dir.is_dir():
        raise CheckpointingException(f"checkpoint directory {checkpoint_dir} does not exist; create it before saving")
    stale = [checkpoint_dir / CONFIG_FNAME, checkpoint_dir / DCP_METADATA_FNAME, checkpoint_dir / COMMON_STATE_FNAME]
    if any(path.exists() for path in stale):
        logger.warning("overwriting the checkpoint in %s", checkpoint_dir)
        for path in stale:
            path.unlink(missing_ok=True)
    # The old save's checksum records would describe files this save rewrites.
    remove_records(checkpoint_dir)


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: TorchDistLoadShardedStrategy = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    verify_integrity: bool = False,
    process_group: Optional[ProcessGroup] = None,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Collective over ``process_group`` (None: all ranks): load the pieces ``sharded_state_dict`` describes from
    ``checkpoint_dir``, whatever layout saved it.

    Returns the checkpoint's common state with every ShardedTensor replaced by its tensor (its ``data`` filled in
    place, or a new CPU tensor when ``data`` is None), every ShardedObject by its object, every factory by its merged
    tensor and every LocalNonpersistentObject unwrapped. With a ``RETURN_*`` ``strict`` mode returns
    ``(state_dict, missing_keys, unexpected_keys)``. With ``verify_integrity`` the checkpoint's files are first
    checked against the integrity manifest its save wrote. The caller's ``sharded_state_dict`` is not modified.
    """
    strict = parse_strict_flag(strict)
    checkpoint_dir = Path(checkpoint_dir)
    check_keys = StrictHandling.requires_explicit_ckpt_mismatch_check(strict)
    need_global_keys = StrictHandling.requires_global_app_metadata(strict)
    local_error, shards, checkpoint_keys = None, [], set()
    try:
        sharded_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
        if verify_integrity:
            verify_integrity_manifest(str(checkpoint_dir))
        common_state_dict = _load_common_state(checkpoint_dir, sharded_strategy)
        structure = dict_list_map_outplace(lambda leaf: leaf, sharded_state_dict)
        # Kept before they are built, so apply_factory_merges can fold the loaded pieces back after reading.
        factories, _ = extract_matching_values(
            structure, lambda leaf: isinstance(leaf, ShardedTensorFactory), return_lists_as_dicts=True
        )
        apply_factories(structure)
        to_load, rest = extract_matching_values(
            structure, lambda leaf: isinstance(leaf, ShardedBase), return_lists_as_dicts=True
        )
        nonpersistent, _ = extract_matching_values(
            rest, lambda leaf: isinstance(leaf, LocalNonpersistentObject), return_lists_as_dicts=True
        )
        shards = list(nested_values(to_load))
        if check_keys:
            stored = sharded_strategy.load_sharded_metadata(checkpoint_dir).values()
            checkpoint_keys = {sh.key for sh in stored if sh.key != COMMON_STATE_KEY}
    except Exception as error:
        local_error = error
    # Outside the try: after a local error shards is empty, and this rank must still join the gather.
    local_keys = {shard.key for shard in shards}
    gathered = all_gather_objects(
        (
            None if local_error is None else describe_error(local_error),
            [shard.without_data() for shard in shards] if validate_access_integrity else None,
            local_keys if need_global_keys else None,
            local_keys - checkpoint_keys if check_keys else set(),
        ),
        process_group,
    )
    raise_gathered_errors([entry[0] for entry in gathered], f"loading checkpoint {checkpoint_dir}")
    if validate_access_integrity:
        validate_sharding_integrity([entry[1] for entry in gathered])

    missing_keys, unexpected_keys = set(), set()
    if check_keys:
        # Missing keys (the *_ALL modes) need every rank's request; using checkpoint_keys leaves none missing.
        global_keys = set().union(*(entry[2] for entry in gathered)) if need_global_keys else checkpoint_keys
        missing_keys, unexpected_keys = determine_missing_and_unexpected_keys(checkpoint_keys, local_keys, global_keys)
        unexpected_by_rank = {rank: entry[3] for rank, entry in enumerate(gathered)}
        _report_mismatch(strict, missing_keys, unexpected_by_rank, checkpoint_dir)
        if unexpected_keys:
            # Keys the checkpoint lacks are left out of the read, which would fail on them.
            _, to_load = extract_matching_values(
                to_load, lambda leaf: leaf.key in unexpected_keys, return_lists_as_dicts=True
            )
        if strict == StrictHandling.IGNORE_ALL:
            missing_keys, unexpected_keys = set(), set()

    loaded = _read_shards(sharded_strategy, to_load, checkpoint_dir, process_group)
    merge(common_state_dict, loaded)
    # A factory's merge_fn gets its pieces nested as its build_fn made them (lists as lists), not as merged.
    state_dict = apply_factory_merges(_restore_lists(common_state_dict, structure), factories)
    merge(state_dict, dict_list_map_outplace(lambda obj: obj.unwrap(), nonpersistent))
    state_dict = _restore_lists(state_dict, sharded_state_dict)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return state_dict, missing_keys, unexpected_keys
    return state_dict


def _read_shards(strategy: LoadShardedStrategy, to_load, checkpoint_dir: Path, process_group) -> StateDict:
    """``strategy.load``; with a process group, this rank's read with the errors gathered over that group."""
    if process_group is None:
        return strategy.load(to_load, checkpoint_dir)
    if not hasattr(strategy, "load_local"):
        raise CheckpointingException(
            f"load(process_group=...) needs a strategy that reads on each rank alone (load_local), such as "
            f"torch_dist's; {type(strategy).__name__} has none"
        )
    loaded, error = None, None
    try:
        loaded = strategy.load_local(to_load, checkpoint_dir)
    except Exception as caught:
        error = caught
    # Only over process_group: the ranks outside it are not reading and must not be waited for.
    gather_and_raise_errors(error, f"loading {checkpoint_dir}", process_group)
    return loaded


def _report_mismatch(strict: StrictHandling, missing_keys, unexpected_by_rank, checkpoint_dir: Path) -> None:
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.LOG_UNEXPECTED):
        # These modes act on unexpected keys only; missing ones are not reported.
        missing_keys = set()
    message = mismatch_message(missing_keys, unexpected_by_rank)
    if not message:
        return
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        raise CheckpointingException(f"the request does not match the checkpoint {checkpoint_dir}: {message}")
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and get_rank() == 0:
        logger.warning("loading %s, skipping mismatched keys: %s", checkpoint_dir, message)


def _restore_lists(loaded, template):
    """Lists of the request come back from the per-index merge as ``{index: value}`` dicts; make them lists."""
    if isinstance(template, dict) and isinstance(loaded, dict):
        for k, sub_template in template.items():
            if k in loaded:
                loaded[k] = _restore_lists(loaded[k], sub_template)
        return loaded
    if isinstance(template, list):
        # A dict keyed exactly 0..n-1 is a list the merge turned into a dict.
        if isinstance(loaded, dict) and set(loaded) == set(range(len(loaded))):
            loaded = [loaded[i] for i in range(len(loaded))]
        if isinstance(loaded, list):
            return [_restore_lists(v, t) for v, t in zip(loaded, template)] + loaded[len(template) :]
    return loaded


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: Union[str, Path],
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
) -> LoadShardedStrategy:
    """The strategy to read ``checkpoint_dir`` with (the default for the backend its ``metadata.json`` names),
    after checking that it is a complete distributed checkpoint that strategy can read."""
    config = verify_checkpoint(str(checkpoint_dir))
    if sharded_strategy is None:
        sharded_strategy = (config.sharded_backend, config.sharded_backend_version)
    sharded_strategy = _resolve_strategy(sharded_strategy, StrategyAction.LOAD_SHARDED, None)
    sharded_strategy.check_backend_compatibility(config.sharded_backend)
    sharded_strategy.check_version_compatibility(config.sharded_backend_version)
    return sharded_strategy


def _load_common_state(checkpoint_dir: Path, sharded_strategy: LoadShardedStrategy) -> StateDict:
    """The legacy ``common.pt`` when the checkpoint has one, else the ``common_state`` object of the shards."""
    # A legacy common.pt wins: _prepare_directory removes it on every new save, so if present it is current.
    if has_legacy_common_state(checkpoint_dir):
        return TorchCommonLoadStrategy("torch", 1).load_common(checkpoint_dir)
    stored = sharded_strategy.load_sharded_metadata(checkpoint_dir)
    request = common_state_sharded_object(None, 0)
    if request.unique_key not in stored:
        raise CheckpointingException(
            f"the checkpoint {checkpoint_dir} has no common state: neither {request.unique_key!r} in its sharded "
            f"files nor a legacy {COMMON_STATE_FNAME}"
        )
    if not hasattr(sharded_strategy, "load_local"):
        raise CheckpointingException(
            f"{type(sharded_strategy).__name__} cannot read the common state of {checkpoint_dir} on one rank"
        )
    common_state_dict = sharded_strategy.load_local({COMMON_STATE_KEY: request}, checkpoint_dir)[COMMON_STATE_KEY]
    if not isinstance(common_state_dict, dict):
        raise CheckpointingException(
            f"the common state {request.unique_key!r} of checkpoint {checkpoint_dir} is corrupt: it holds a "
            f"{type(common_state_dict).__name__}, not a dict"
        )
    return common_state_dict


def load_common_state_dict(checkpoint_dir: Union[str, Path]) -> StateDict:
    """The common (non-sharded) state of a checkpoint, read by this rank alone (no collective): from a legacy
    ``common.pt`` when there is one, else from the ``common_state`` object stored with the shards."""
    checkpoint_dir = Path(checkpoint_dir)
    return _load_common_state(checkpoint_dir, verify_checkpoint_and_load_strategy(checkpoint_dir))


def load_content_metadata(
    checkpoint_dir: Optional[str] = None, *, preloaded_state_dict: Optional[StateDict] = None
) -> Optional[dict]:
    """The ``content_metadata`` given to :func:`save`, or None when it was saved without; read from the common
    state of ``checkpoint_dir``, or taken from an already loaded common state (``preloaded_state_dict``)."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def load_tensors_metadata(
    checkpoint_dir: str, sharded_strategy: TorchDistLoadShardedStrategy = None
) -> Dict[str, Union[ShardedTensor, ShardedObject]]:
    """``{key: data-less ShardedTensor}`` for every stored tensor (global shape and dtype; offsets zero); no
    collective. The keys are the ShardedTensor keys, not state dict keys."""
    strategy = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    return strategy.load_tensors_metadata(Path(checkpoint_dir))


def load_sharded_metadata(
    checkpoint_dir: str, sharded_strategy: TorchDistLoadShardedStrategy = None
) -> Dict[str, Union[ShardedTensor, ShardedObject]]:
    """:func:`load_tensors_metadata` plus ``{unique_key: data-less ShardedObject}`` for stored objects."""
    strategy = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    return strategy.load_sharded_metadata(Path(checkpoint_dir))


def load_plain_tensors(checkpoint_dir: str) -> StateDict:
    """``{key: whole tensor}`` for every stored tensor, read by this rank alone (no collective)."""
    strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
    return strategy.load_local(strategy.load_tensors_metadata(Path(checkpoint_dir)), Path(checkpoint_dir))


def remove_sharded_tensors(checkpoint_dir: str, key_prefix: str) -> None:
    """Drop the stored tensors whose key starts with ``key_prefix`` from the checkpoint (one rank; e.g. to make a
    weights-only checkpoint from a training one without rewriting the data files)."""
    strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
    strategy.remove_sharded_tensors(str(checkpoint_dir), key_prefix)
