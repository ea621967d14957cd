"""CheckpointableShardedTensor / LocalShardsContainer: ShardedTensors through PyTorch's own DCP save and load."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import MetadataIndex

from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor
from megatron.core.dist_checkpointing.strategies.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
)


def _halves(base):
    # Two pieces of one (4, 3) global tensor held by this process (as two ranks' pieces would be).
    rows = torch.arange(12.0).reshape(4, 3) + base
    return [ShardedTensor.from_rank_offsets("w", rows[2 * i : 2 * i + 2].clone(), (0, i, 2)) for i in range(2)]


def test_pieces_are_stored_as_one_global_tensor_and_load_in_place(tmp_path):
    saved = _halves(0)
    dcp.save(
        {"w": LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(p) for p in saved])}, checkpoint_id=tmp_path
    )
    entry = FileSystemReader(tmp_path).read_metadata().state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata) and tuple(entry.size) == (4, 3)
    # Read back with another layout: the whole tensor in one piece, and a flattened slice of it.
    whole = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3))
    flat = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(5), (4, 3), flattened_range=slice(4, 9))
    dcp.load({"w": CheckpointableShardedTensor.from_sh_ten(whole)}, checkpoint_id=tmp_path)
    assert torch.equal(whole.data, torch.arange(12.0).reshape(4, 3))
    dcp.load({"w": CheckpointableShardedTensor.from_sh_ten(flat)}, checkpoint_id=tmp_path)
    assert torch.equal(flat.data, torch.arange(4.0, 9.0))


def test_errors_name_the_piece_and_the_fix():
    piece = _halves(0)[1]
    with pytest.raises(CheckpointingException, match="'w': the ShardedTensor has no data"):
        CheckpointableShardedTensor.from_sh_ten(piece.without_data())
    with pytest.raises(CheckpointingException, match="'w': data must be the ShardedTensor's own data"):
        CheckpointableShardedTensor(piece.data.clone(), piece)
    wrapped = CheckpointableShardedTensor.from_sh_ten(piece)
    with pytest.raises(CheckpointingException, match=r"holds no chunk at offset \(0, 0\) \(its chunks start at"):
        wrapped.__get_tensor_shard__(MetadataIndex("w", torch.Size([0, 0])))
    with pytest.raises(CheckpointingException, match="tensor operation .* is not supported on it"):
        wrapped + 1
    other = CheckpointableShardedTensor.from_sh_ten(ShardedTensor.from_rank_offsets("v", torch.zeros(3)))
    with pytest.raises(CheckpointingException, match="piece 'v' has global shape"):
        LocalShardsContainer([wrapped, other])
    with pytest.raises(CheckpointingException, match="needs at least one"):
        LocalShardsContainer([])
