"""CachedMetadataFileSystemReader: a DCP FileSystemReader that reads each checkpoint directory's metadata once."""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies import cached_metadata_filesystem_reader as reader_module
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)


@pytest.fixture(autouse=True)
def empty_cache():
    CachedMetadataFileSystemReader.clear_metadata_cache()
    yield
    CachedMetadataFileSystemReader.clear_metadata_cache()


def _save(directory, value):
    dcp.save({"weight": torch.full((2, 3), float(value))}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)


def _count_reads(monkeypatch):
    reads = []
    real = reader_module.read_dcp_metadata

    def counting(path):
        reads.append(path)
        return real(path)

    monkeypatch.setattr(reader_module, "read_dcp_metadata", counting)
    return reads


def test_loads_a_checkpoint_like_the_plain_reader(tmp_path):
    _save(tmp_path, 7)
    loaded = {"weight": torch.zeros(2, 3)}
    dcp.load(loaded, storage_reader=CachedMetadataFileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(loaded["weight"], torch.full((2, 3), 7.0))
    assert set(CachedMetadataFileSystemReader(tmp_path).read_metadata().state_dict_metadata) == {"weight"}


def test_metadata_is_read_once_per_directory_and_shared_between_readers(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    _save(first, 1)
    _save(second, 2)
    reads = _count_reads(monkeypatch)
    one = CachedMetadataFileSystemReader(first).read_metadata()
    # Another reader of the same directory, reached by another spelling of the path, gets the same object.
    assert CachedMetadataFileSystemReader(str(first / ".." / "first")).read_metadata() is one
    other = CachedMetadataFileSystemReader(second).read_metadata()
    assert other is not one
    assert len(reads) == 2


def test_without_cache_metadata_every_call_reads_the_file(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    reads = _count_reads(monkeypatch)
    reader = CachedMetadataFileSystemReader(tmp_path, cache_metadata=False)
    reader.read_metadata()
    reader.read_metadata()
    assert len(reads) == 2
    assert CachedMetadataFileSystemReader._metadata_cache == {}


def test_clear_metadata_cache_makes_a_rewritten_directory_read_again(tmp_path):
    _save(tmp_path / "a", 1)
    stale = CachedMetadataFileSystemReader(tmp_path / "a").read_metadata()
    CachedMetadataFileSystemReader.clear_metadata_cache()
    assert CachedMetadataFileSystemReader(tmp_path / "a").read_metadata() is not stale


def test_missing_metadata_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(CheckpointingException, match=r"\.metadata is missing: the checkpoint .* is incomplete"):
        CachedMetadataFileSystemReader(tmp_path).read_metadata()


class _RunsCode:
    def __reduce__(self):
        return (print, ("unpickled",))


def test_metadata_is_unpickled_through_the_allow_list(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointingException, match=r"builtins.print, which is not in the allow-list"):
        CachedMetadataFileSystemReader(tmp_path).read_metadata()
