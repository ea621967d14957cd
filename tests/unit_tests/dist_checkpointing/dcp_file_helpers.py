"""Reading a checkpoint's files with PyTorch's DCP reader alone, independently of megatron's loader."""

import io

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from megatron.core.safe_globals import register_safe_globals


def load_plain_objects(checkpoint_dir):
    """{unique key: the unpickled bytes} of every stored object, read with PyTorch's DCP reader alone."""
    register_safe_globals()  # the common state holds e.g. argparse.Namespace
    reader = FileSystemReader(checkpoint_dir)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    names = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    items = [
        ReadItem(
            LoadItemType.BYTE_IO, MetadataIndex(n), torch.Size([0]), MetadataIndex(n), torch.Size([0]), torch.Size([0])
        )
        for n in names
    ]
    found = {}

    class Collect:
        def load_bytes(self, item, value: io.BytesIO):
            found[item.dest_index.fqn] = torch.load(value, weights_only=True)

    reader.read_data(LoadPlan(items), Collect()).wait()
    return found
