"""Megatron-LM's ``torch_dcp`` checkpoint format: the plain state dict saved with ``torch.distributed.checkpoint``.

``<save>/iter_0000100/`` holds ``.metadata`` and ``__<rank>_0.distcp`` files of one plain state dict (the model's
``state_dict_for_save_checkpoint()``, the optimizer's ``state_dict()``, the scheduler, the RNG state list, the
arguments, ...), flattened by DCP into keys such as ``model.decoder.layers.0.mlp.linear_fc1.weight``. Ranks holding
the same key hold the same value, which is why the format is used without tensor, pipeline or expert parallelism
(Megatron-LM uses it with FSDP2, whose DTensors carry their own sharding).

Loading fills a template of the same structure in place. PyTorch's own reader unpickles ``.metadata`` and every
non-tensor value without restriction; here both go through the safe-globals allow-list.
"""

import io
import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from megatron.core.dist_checkpointing.checksums import ChecksummingFileSystem, VerifyingFileSystem
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata


class _AllowListReader(FileSystemReader):
    """A DCP file reader whose ``.metadata`` is unpickled with the allow-list, and whose files are verified against
    their checksums."""

    def __init__(self, checkpoint_dir: str):
        super().__init__(checkpoint_dir)
        self.fs = VerifyingFileSystem(checkpoint_dir)

    def read_metadata(self, *args, **kwargs):
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _AllowListPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that stored objects are unpickled with the allow-list."""

    def __init__(self, checkpoint_dir: str):
        super().__init__()
        self.checkpoint_dir = checkpoint_dir

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = safe_torch_load(value, f"entry {fqn!r} of torch_dcp checkpoint {self.checkpoint_dir}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def stored_keys(checkpoint_dir: str) -> set:
    """The flattened keys the checkpoint stores (``model.<name>``, ``optimizer.state.0.exp_avg``, ``args``...)."""
    return set(read_dcp_metadata(checkpoint_dir).state_dict_metadata)


def save_dcp_checkpoint(state_dict: dict, checkpoint_dir: str) -> None:
    """Save ``state_dict`` to ``checkpoint_dir`` (a collective; ``.metadata`` is written last, by rank 0)."""
    if dist.get_rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
    dist.barrier()
    writer = FileSystemWriter(checkpoint_dir)
    writer.fs = ChecksummingFileSystem(checkpoint_dir)  # checksums computed as the files are written
    dcp.save(state_dict, storage_writer=writer)


def load_dcp_checkpoint(template: dict, checkpoint_dir: str) -> dict:
    """Fill ``template`` from ``checkpoint_dir`` in place (a collective) and return it: tensors are copied into the
    template's tensors, other values replaced by the stored ones."""
    try:
        dcp.load(template, storage_reader=_AllowListReader(checkpoint_dir), planner=_AllowListPlanner(checkpoint_dir))
    except CheckpointingException:
        raise
    except CheckpointException as error:  # DCP's: a BaseException carrying each failed rank's own exception
        rank, (cause, _) = min(error.failures.items(), key=lambda failure: failure[0])
        raise CheckpointingException(
            f"could not load torch_dcp checkpoint {checkpoint_dir} (rank {rank}): {cause}"
        ) from None
    except Exception as error:
        raise CheckpointingException(f"could not load torch_dcp checkpoint {checkpoint_dir}: {error}") from error
    return template
