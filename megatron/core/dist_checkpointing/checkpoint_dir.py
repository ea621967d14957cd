"""The on-disk layout of a Megatron training checkpoint directory, shared by training and the Hugging Face conversion.

``<save>/iter_0000100/`` holds the distributed (``torch_dist``) checkpoint of iteration 100 (``release/`` for a
release checkpoint) and ``<save>/latest_checkpointed_iteration.txt`` (the tracker) holds the iteration number (or
``release``), as in Megatron-LM. A save writes ``metadata.json`` and the DCP index last, so a directory lacking them
is the remains of an interrupted save; :func:`find_checkpoint_to_load` refuses it. Everything here is plain path
handling: no training globals, so ``megatron.core`` (the HF conversion) and tools can use it.

The same directory may instead hold Megatron-LM's other formats (:func:`checkpoint_format` tells which): ``torch``,
one ``mp_rank_<tp>[_<pp>][_<ep>]/model_optim_rng.pt`` per model-parallel rank, complete once rank 0's file exists
(files are renamed into place whole); ``torch_dcp``, a plain PyTorch DCP checkpoint, complete once its ``.metadata``
exists.
"""

import os
import shutil
from pathlib import Path
from typing import List, Optional, Tuple, Union

from megatron.core.public_api import public_api
from megatron.core.dist_checkpointing.checksums import ChecksumMismatchError, load_verified_config
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingException
from megatron.core.dist_checkpointing.safe_load import CorruptCheckpointError
from megatron.core.dist_checkpointing.strategies.torch import DCP_METADATA_FNAME, read_dcp_metadata

TRACKER_FNAME = "latest_checkpointed_iteration.txt"


RELEASE_DIRNAME = "release"


CHECKPOINT_VERSION = 3.0


def _parallel_rank(explicit, getter):
    from megatron.core import parallel_state

    if explicit is not None:
        return explicit
    return getter() if parallel_state.model_parallel_is_initialized() else 0


@public_api("megatron.training.checkpointing")
def get_checkpoint_name(
    checkpoints_path,
    iteration,
    release=False,
    pipeline_parallel=None,
    tensor_rank=None,
    pipeline_rank=None,
    expert_parallel=None,
    expert_rank=None,
    return_base_dir=False,
    basename="model_optim_rng.pt",
):
    """The checkpoint of ``iteration``: with ``return_base_dir`` its directory ``<checkpoints_path>/iter_<7 digits>``
    (or ``/release``); else this rank's file of the legacy per-rank format,
    ``<dir>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/<basename>``. Ranks (and whether pipeline / expert parallelism
    is used) default to this process's."""
    from megatron.core import parallel_state

    directory = os.path.join(checkpoints_path, RELEASE_DIRNAME if release else f"iter_{iteration:07d}")
    if return_base_dir:
        return directory
    if pipeline_parallel is None:
        pipeline_parallel = _parallel_rank(None, parallel_state.get_pipeline_model_parallel_world_size) > 1
    if expert_parallel is None:
        expert_parallel = _parallel_rank(None, parallel_state.get_expert_model_parallel_world_size) > 1
    name = f"mp_rank_{_parallel_rank(tensor_rank, parallel_state.get_tensor_model_parallel_rank):02d}"
    if pipeline_parallel:
        name += f"_{_parallel_rank(pipeline_rank, parallel_state.get_pipeline_model_parallel_rank):03d}"
    if expert_parallel:
        name += f"_{_parallel_rank(expert_rank, parallel_state.get_expert_model_parallel_rank):03d}"
    return os.path.join(directory, name, basename)


@public_api("megatron.training.checkpointing")
def get_distributed_optimizer_checkpoint_name(model_checkpoint_name):
    """The legacy format's distributed-optimizer file beside a rank's model file: ``distrib_optim.pt``."""
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


@public_api("megatron.training.checkpointing")
def get_checkpoint_tracker_filename(checkpoints_path):
    """``<checkpoints_path>/latest_checkpointed_iteration.txt``."""
    return os.path.join(checkpoints_path, TRACKER_FNAME)


@public_api("megatron.training.checkpointing")
def checkpoint_exists(checkpoints_path):
    """Whether ``checkpoints_path`` has a tracker file, i.e. a checkpoint to resume from."""
    if checkpoints_path is None:
        return False
    return os.path.exists(get_checkpoint_tracker_filename(checkpoints_path))


@public_api("megatron.training.checkpointing")
def read_metadata(tracker_filename) -> Tuple[int, bool]:
    """(iteration, release) from a tracker file holding an iteration number or ``release``."""
    try:
        text = Path(tracker_filename).read_bytes().decode("ascii").strip()
    except FileNotFoundError:
        raise CheckpointingException(f"checkpoint tracker {tracker_filename} does not exist") from None
    except UnicodeDecodeError:
        raise CheckpointingException(
            f"checkpoint tracker {tracker_filename} is damaged (it holds non-text bytes, not an iteration number or "
            "'release'); write the iteration of the checkpoint to resume from into it"
        ) from None
    if text == RELEASE_DIRNAME:
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointingException(
            f"checkpoint tracker {tracker_filename} holds {text[:80]!r}, not an iteration number or 'release'; "
            "write the iteration of the checkpoint to resume from into it"
        ) from None
    if iteration < 0:
        raise CheckpointingException(f"checkpoint tracker {tracker_filename} holds the negative iteration {iteration}")
    return iteration, False


def write_tracker_atomically(checkpoints_path: Union[str, Path], iteration) -> None:
    """Point the tracker at ``iteration`` (or ``"release"``): write a temporary file, fsync it, rename it over the
    tracker and fsync the directory, so readers see the old or the new value and never a partial file."""
    tracker = get_checkpoint_tracker_filename(checkpoints_path)
    temporary = f"{tracker}.tmp.{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, tracker)
    directory = os.open(checkpoints_path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


LEGACY_RANK_DIR_PREFIX = "mp_rank_"
LEGACY_BASENAME = "model_optim_rng.pt"


def legacy_rank_0_file(checkpoint_dir: Union[str, Path]) -> Optional[str]:
    """Rank 0's ``model_optim_rng.pt`` of the legacy checkpoint in ``checkpoint_dir`` (``mp_rank_00``, with or
    without the pipeline and expert rank suffixes), or None when there is none."""
    for rank_dir in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        path = os.path.join(checkpoint_dir, rank_dir, LEGACY_BASENAME)
        if os.path.isfile(path):
            return path
    return None


def _is_plain_dcp(checkpoint_dir: Union[str, Path]) -> bool:
    """A ``.metadata`` without ``metadata.json`` is a ``torch_dcp`` checkpoint, or a ``torch_dist`` save that was
    interrupted before its last file; the plain state dict of the former stores ``checkpoint_version`` as a key.
    An unreadable ``.metadata`` is the torn last write of such an interrupted save; one that fails its checksums
    was written whole and damaged since (that ChecksumMismatchError is raised)."""
    if not os.path.exists(os.path.join(checkpoint_dir, DCP_METADATA_FNAME)):
        return False
    try:
        return "checkpoint_version" in read_dcp_metadata(Path(checkpoint_dir)).state_dict_metadata
    except CorruptCheckpointError:
        return False


def checkpoint_format(checkpoint_dir: Union[str, Path]) -> Optional[str]:
    """The format of the checkpoint in ``checkpoint_dir``: ``torch_dist`` (it has ``metadata.json``), ``torch``
    (``mp_rank_*`` directories), ``torch_dcp`` (a plain DCP checkpoint), or None when it holds none of them (or the
    remains of an interrupted ``torch_dist`` save)."""
    if os.path.exists(os.path.join(checkpoint_dir, CONFIG_FNAME)):
        return "torch_dist"
    if os.path.isdir(checkpoint_dir) and any(n.startswith(LEGACY_RANK_DIR_PREFIX) for n in os.listdir(checkpoint_dir)):
        return "torch"
    if _is_plain_dcp(checkpoint_dir):
        return "torch_dcp"
    return None


def _missing_completion_markers(checkpoint_dir: Union[str, Path]) -> List[str]:
    """The files a finished save writes last that ``checkpoint_dir`` lacks: rank 0's file of a legacy checkpoint,
    the ``.metadata`` of a ``torch_dcp`` one, else ``metadata.json`` and the DCP index of a ``torch_dist`` one."""
    found = checkpoint_format(checkpoint_dir)
    if found == "torch":
        return [] if legacy_rank_0_file(checkpoint_dir) else [f"{LEGACY_RANK_DIR_PREFIX}00*/{LEGACY_BASENAME}"]
    if found == "torch_dcp":
        return []  # _is_plain_dcp found its .metadata
    markers = (CONFIG_FNAME, DCP_METADATA_FNAME)
    return [name for name in markers if not os.path.exists(os.path.join(checkpoint_dir, name))]


def find_checkpoint_to_load(
    load_dir: Union[str, Path], iteration: Optional[int] = None
) -> Optional[Tuple[str, int, bool]]:
    """(checkpoint directory, iteration, release) of the checkpoint to resume from, or None when ``load_dir`` has
    no tracker (a fresh start). ``iteration`` overrides the tracker (``--ckpt-step``). Raises, naming the directory
    and the missing files, when that checkpoint is not complete."""
    release = False
    if iteration is None:
        tracker = get_checkpoint_tracker_filename(load_dir)
        if not os.path.exists(tracker):
            return None
        iteration, release = read_metadata(tracker)
        source = f"named by {tracker}"
    else:
        source = "requested"
    checkpoint_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    what = f"checkpoint {checkpoint_dir} ({source})"
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointingException(f"{what} does not exist")
    missing = _missing_completion_markers(checkpoint_dir)
    if missing:
        raise CheckpointingException(
            f"{what} is incomplete: {', '.join(missing)} missing (its save was interrupted); resume from an earlier "
            "iteration by writing it into the tracker file, or remove the directory"
        )
    load_verified_config(checkpoint_dir)  # raises on a corrupt metadata.json
    return checkpoint_dir, iteration, release


@public_api("megatron.training.checkpointing")
def find_checkpoint_rank_0(checkpoints_path, iteration, release=False):
    """Rank 0's file of the legacy checkpoint of ``iteration``, else the directory of its distributed
    (``torch_dist``) checkpoint when that is complete, else None (no collective: any rank may ask)."""
    checkpoint_dir = get_checkpoint_name(checkpoints_path, iteration, release, return_base_dir=True)
    legacy_file = legacy_rank_0_file(checkpoint_dir)
    if legacy_file is not None:
        return legacy_file
    if checkpoint_format(checkpoint_dir) != "torch_dist" or _missing_completion_markers(checkpoint_dir):
        return None
    return checkpoint_dir


def incomplete_checkpoints(checkpoints_path: Union[str, Path]) -> List[Tuple[int, str]]:
    """(iteration, directory) of every ``iter_*`` checkpoint under ``checkpoints_path`` whose save never finished.

    ``metadata.json`` is the last file a save writes (after every rank's data is durable), so a directory without
    it, or without the DCP index, is the remains of an interrupted save: the tracker never pointed at it.
    """
    found = []
    if not os.path.isdir(checkpoints_path):
        return found
    for name in sorted(os.listdir(checkpoints_path)):
        directory = os.path.join(checkpoints_path, name)
        if not (name.startswith("iter_") and name[5:].isdigit() and os.path.isdir(directory)):
            continue
        try:
            if _missing_completion_markers(directory):
                found.append((int(name[5:]), directory))
        except ChecksumMismatchError:
            continue  # damaged, not incomplete: never removed; loading it reports the damage
    return found


def describe_incomplete_checkpoints(checkpoints_path: Union[str, Path]) -> List[str]:
    """One line per incomplete checkpoint, saying that it is ignored and when it goes away."""
    return [
        f"ignoring incomplete checkpoint {os.path.basename(directory)} in {checkpoints_path}: no metadata (its save "
        "was interrupted); it is removed after the next successful save"
        for _, directory in incomplete_checkpoints(checkpoints_path)
    ]


def remove_incomplete_checkpoints(checkpoints_path: Union[str, Path], saved_iteration: int) -> List[str]:
    """Delete the incomplete checkpoints of iterations before ``saved_iteration``, which was just marked latest.

    Only earlier iterations: asynchronous saves finish in order, so an earlier one still lacking its metadata was
    interrupted, while a later one may be in flight. Complete checkpoints are never touched. Returns what was removed.
    """
    removed = []
    for iteration, directory in incomplete_checkpoints(checkpoints_path):
        if iteration < saved_iteration:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed
