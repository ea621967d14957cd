"""Training-checkpoint layout: where each iteration's checkpoint lives and which one is "latest".

``<save>/iter_0000100/`` holds the distributed checkpoint of iteration 100 (``release/`` for a release checkpoint)
and ``<save>/latest_checkpointed_iteration.txt`` holds the iteration number (or ``release``), as in Megatron-LM.
The tracker is replaced atomically and only after every rank's data is durable, so a save interrupted at any moment
leaves the previous checkpoint as "latest" and loadable; :func:`find_checkpoint_to_load` refuses an incomplete one.
"""

import os
from pathlib import Path
from typing import Optional, Tuple, Union

from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingException, maybe_load_config
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.torch import DCP_METADATA_FNAME

TRACKER_FNAME = "latest_checkpointed_iteration.txt"
RELEASE_DIRNAME = "release"


def get_checkpoint_name(checkpoints_path: Union[str, Path], iteration: int, release: bool = False) -> str:
    """``<checkpoints_path>/iter_<iteration, 7 digits>``, or ``<checkpoints_path>/release``."""
    directory = RELEASE_DIRNAME if release else f"iter_{iteration:07d}"
    return os.path.join(checkpoints_path, directory)


def get_checkpoint_tracker_filename(checkpoints_path: Union[str, Path]) -> str:
    """``<checkpoints_path>/latest_checkpointed_iteration.txt``."""
    return os.path.join(checkpoints_path, TRACKER_FNAME)


def read_metadata(tracker_filename: Union[str, Path]) -> Tuple[int, bool]:
    """(iteration, release) from a tracker file holding an iteration number or ``release``."""
    try:
        text = Path(tracker_filename).read_text().strip()
    except FileNotFoundError:
        raise CheckpointingException(f"checkpoint tracker {tracker_filename} does not exist") from None
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
        raise CheckpointingException(
            f"checkpoint tracker {tracker_filename} holds the negative iteration {iteration}"
        )
    return iteration, False


def write_tracker_atomically(checkpoints_path: Union[str, Path], iteration: int) -> None:
    """Point the tracker at ``iteration``: write a temporary file, fsync it, rename it over the tracker and fsync
    the directory, so readers see the old or the new iteration and never a partial file."""
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
    checkpoint_dir = get_checkpoint_name(load_dir, iteration, release)
    what = f"checkpoint {checkpoint_dir} ({source})"
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointingException(f"{what} does not exist")
    missing = [
        name
        for name in (CONFIG_FNAME, DCP_METADATA_FNAME, COMMON_STATE_FNAME)
        if not os.path.exists(os.path.join(checkpoint_dir, name))
    ]
    if missing:
        raise CheckpointingException(
            f"{what} is incomplete: {', '.join(missing)} missing (its save was interrupted); resume from an earlier "
            "iteration by writing it into the tracker file, or remove the directory"
        )
    maybe_load_config(checkpoint_dir)  # raises on a corrupt metadata.json
    return checkpoint_dir, iteration, release
