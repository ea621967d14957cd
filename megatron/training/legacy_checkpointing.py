"""Megatron-LM's legacy ``torch`` checkpoint format: one ``torch.save`` file per model-parallel rank.

``<save>/iter_0000100/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/model_optim_rng.pt`` holds that rank's plain state
dict (the model chunks' ``state_dict_for_save_checkpoint()``, the optimizer's ``state_dict()``, the scheduler, the
RNG state list, the arguments, ...). The first data-parallel replica writes it (data-parallel rank 0, and
expert-data-parallel rank 0 for expert shards). With the distributed optimizer, the optimizer's ``state_dict()``
there holds only what every data-parallel rank shares (param groups with the step, the loss scaler), and
``distrib_optim.pt`` beside it the parameter state (fp32 main parameters, Adam's moments) gathered over the
data-parallel ranks into padding-free tensors (``optimizer.save_parameter_state``); so, as in Megatron-LM, such a
checkpoint also loads at another data-parallel size.

Each file is written to a temporary name and renamed into place, so a file that exists is whole. Files are read
with the safe-globals allow-list (``safe_torch_load``), never by unrestricted unpickling. A legacy checkpoint loads
only into the tensor / pipeline / expert layout that saved it; ``--ckpt-convert-format torch_dist`` turns it into a
distributed checkpoint, which loads into any layout.
"""

import os

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.checkpoint_dir import (
    LEGACY_RANK_DIR_PREFIX,
    get_checkpoint_name,
    get_distributed_optimizer_checkpoint_name,
)
from megatron.core.dist_checkpointing.checksums import (
    capture_records,
    legacy_root,
    safe_torch_load_verified,
    torch_save,
    write_record,
)
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.public_api import public_api


def _writes_model_file(dp_group) -> bool:
    """One rank per (tensor, pipeline, expert) shard writes: the first replica of the dense or the expert
    parameters (either alone misses shards when the dense and expert layouts differ)."""
    expert_dp_rank = parallel_state.get_expert_data_parallel_rank()
    return dist.get_rank(dp_group) == 0 or expert_dp_rank == 0


def _move_into_place(temporary: str, path: str, records) -> None:
    """Rename a written file to its name, after the checksum record taken while it was written."""
    root = legacy_root(path)
    write_record(root, os.path.relpath(path, root).replace(os.sep, "/"), records[temporary])
    os.replace(temporary, path)


def save_legacy_checkpoint(state_dict: dict, save_dir: str, iteration: int, release: bool, optimizer, args, dp_group):
    """Write this rank's ``model_optim_rng.pt`` (and with the distributed optimizer its ``distrib_optim.pt``, a
    collective over the data-parallel ranks), each checksummed as it is written and renamed into place after its
    record (``checksums/mp_rank_*/<file>.json``). Every rank calls it; the caller marks the checkpoint latest."""
    checkpoint_name = get_checkpoint_name(save_dir, iteration, release)
    if args.use_distributed_optimizer and not args.no_save_optim and optimizer is not None:
        optimizer_file = get_distributed_optimizer_checkpoint_name(checkpoint_name)
        os.makedirs(os.path.dirname(optimizer_file), exist_ok=True)
        temporary = f"{optimizer_file}.tmp.{os.getpid()}"
        with capture_records() as records:
            optimizer.save_parameter_state(temporary)  # written by the data-parallel rank 0 ranks only
        if os.path.exists(temporary):
            _move_into_place(temporary, optimizer_file, records)
    if _writes_model_file(dp_group):
        os.makedirs(os.path.dirname(checkpoint_name), exist_ok=True)
        temporary = f"{checkpoint_name}.tmp.{os.getpid()}"
        with capture_records() as records:
            torch_save(state_dict, temporary)
        _move_into_place(temporary, checkpoint_name, records)


def _check_layout(saved_args, checkpoint_dir: str) -> None:
    """A legacy file holds one rank's shards: only the layout that saved it can use them."""
    if saved_args is None:
        return
    sizes = {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
    }
    differing = [
        f"{name} {getattr(saved_args, name)} (this run {size})"
        for name, size in sizes.items()
        if getattr(saved_args, name, 1) != size
    ]
    if differing:
        raise CheckpointingException(
            f"legacy (torch) checkpoint {checkpoint_dir} was saved with {', '.join(differing)}; a legacy checkpoint "
            "loads only into the layout that saved it. Load it with that layout and convert it with "
            "--ckpt-convert-format torch_dist (distributed checkpoints load into any layout)"
        )


def load_legacy_state_dict(checkpoint_dir: str, iteration: int, release: bool) -> dict:
    """This rank's state dict of the legacy checkpoint in ``checkpoint_dir``, read with the allow-list."""
    checkpoint_name = get_checkpoint_name(os.path.dirname(checkpoint_dir), iteration, release)
    if not os.path.isfile(checkpoint_name):
        present = sorted(n for n in os.listdir(checkpoint_dir) if n.startswith(LEGACY_RANK_DIR_PREFIX))
        raise CheckpointingException(
            f"legacy (torch) checkpoint {checkpoint_dir} has no {checkpoint_name} for this rank (it holds "
            f"{', '.join(present)}): it was saved with another tensor / pipeline / expert layout; load it with the "
            "layout that saved it"
        )
    state_dict = safe_torch_load_verified(checkpoint_name, f"legacy checkpoint file {checkpoint_name}")
    if not isinstance(state_dict, dict):
        raise CheckpointingException(
            f"legacy checkpoint file {checkpoint_name} holds a {type(state_dict).__name__}, not a state dict"
        )
    _check_layout(state_dict.get("args"), checkpoint_dir)
    return state_dict


def load_distributed_optimizer_state(optimizer, checkpoint_dir: str, iteration: int, release: bool, args) -> None:
    """Load ``distrib_optim.pt`` (the distributed optimizer's parameter state) beside this rank's model file, after
    the optimizer's ``load_state_dict`` (a collective over the data-parallel ranks)."""
    model_file = get_checkpoint_name(os.path.dirname(checkpoint_dir), iteration, release)
    optimizer.load_parameter_state(
        get_distributed_optimizer_checkpoint_name(model_file),
        update_legacy_format=args.ckpt_convert_update_legacy_dist_opt_format,
    )


@public_api("megatron.training.checkpointing")
def save_grads(save_dir, state_dict, iteration, grad_label):
    """Dump gradients (``state_dict``: {model chunk: {parameter name: gradient}}) to
    ``<save_dir>/<grad_label>/iter_<iteration:07d>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>].pth``, Megatron-LM's layout
    for ``--save-wgrads-interval`` / ``--save-dgrads-interval`` dumps. Every rank calls it; expert-data-parallel rank
    0 writes, so the dense gradients appear once per expert shard (as in Megatron-LM, left to post-processing)."""
    if save_dir is None or iteration is None:
        raise ValueError(f"save_grads needs a save_dir and an iteration, got save_dir={save_dir!r}, {iteration=}")
    if parallel_state.get_expert_data_parallel_rank() != 0:
        return
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
    directory = os.path.join(save_dir, grad_label, f"iter_{iteration:07d}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.pth")
    temporary = f"{path}.tmp.{os.getpid()}"
    # A plain dict (not a defaultdict) loads back without our classes on the allow-list.
    torch.save(dict(state_dict), temporary)
    os.replace(temporary, path)  # a reader never sees half a dump
