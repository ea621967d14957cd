"""Checksums of torch_dist checkpoints: written with the files, checked on load, every kind of file named when
damaged (at its start, middle and end), nothing on disk changed by a failed load; checkpoints without checksums
load with one notice; verification can be switched off."""

import io
import json
import logging
import re

import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor, load, save
from megatron.core.dist_checkpointing import checksums
from megatron.core.dist_checkpointing.checksums import (
    BIG_WRITE,
    ChecksumMismatchError,
    ChecksumStream,
    VerifiedStream,
    record_path,
    verification,
)
from megatron.core.dist_checkpointing.serialization import load_common_state_dict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata
from tests.unit_tests.test_utilities import run_distributed

BIG = (300, 300)  # 360 KB of float32: stored as a large segment, read in place


def _state(value=1.0):
    return {
        "big": ShardedTensor.from_rank_offsets("big", torch.full(BIG, value)),
        "small": ShardedTensor.from_rank_offsets("small", torch.arange(6.0) * value),
        "object": ShardedObject("object", {"note": "kept"}, (1,), (0,)),
        "iteration": 7,
    }


def _request():
    return {
        "big": ShardedTensor.from_rank_offsets("big", torch.zeros(BIG)),
        "small": ShardedTensor.from_rank_offsets("small", torch.zeros(6)),
        "object": ShardedObject("object", None, (1,), (0,)),
    }


def _snapshot(directory):
    return {path: path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


def _flip(path, position):
    content = bytearray(path.read_bytes())
    content[position] ^= 0xFF
    path.write_bytes(bytes(content))


def _common_state_range(directory):
    metadata = read_dcp_metadata(directory)
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == "common_state/shard_0_1"]
    return directory / info.relative_path, info.offset, info.length


def _target(directory, kind, where):
    """(file, byte position) to damage: a shard, the DCP index, the common state inside a shard, metadata.json."""
    if kind == "common state":
        path, offset, length = _common_state_range(directory)
    else:
        path = directory / {"shard": "__0_0.distcp", "index": ".metadata", "config": "metadata.json"}[kind]
        offset, length = 0, path.stat().st_size
    return path, offset + {"start": 0, "middle": length // 2, "end": length - 1}[where]


@pytest.mark.parametrize("where", ["start", "middle", "end"])
@pytest.mark.parametrize("kind", ["shard", "index", "common state", "config"])
def test_a_flipped_byte_is_named_with_its_byte_range_and_nothing_is_changed(tmp_path, kind, where):
    save(_state(), tmp_path)
    path, position = _target(tmp_path, kind, where)
    _flip(path, position)
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointingException) as raised:
        load(_request(), str(tmp_path))
    message = str(raised.value)
    found = re.search(rf"checkpoint file {re.escape(str(path))} is corrupt: bytes (\d+)-(\d+) \(of (\d+)\)", message)
    assert found, message
    first, last, size = map(int, found.groups())
    assert first <= position <= last and size == path.stat().st_size
    assert "--no-ckpt-verify" in message and "load an earlier checkpoint" in message
    assert _snapshot(tmp_path) == before


def test_a_large_tensor_is_checked_in_the_readers_buffer(tmp_path):
    """Its bytes are read once, straight into torch's buffer, and checked there (no second read, no copy)."""
    save(_state(2.0), tmp_path)
    path = tmp_path / "__0_0.distcp"
    record = checksums.record_for(path, tmp_path)
    big = [segment for segment in record.segments if segment[1] >= BIG_WRITE]
    assert [length for _, length, _ in big] == [BIG[0] * BIG[1] * 4]
    assert torch.equal(load(_request(), str(tmp_path))["big"], torch.full(BIG, 2.0))


def test_a_truncated_file_and_a_missing_or_damaged_record_are_named(tmp_path):
    save(_state(), tmp_path)
    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointingException, match=rf"{shard} is \d+ bytes, but \d+ were written"):
        load(_request(), str(tmp_path))
    save(_state(), tmp_path)
    record = record_path(tmp_path, "__0_0.distcp")
    body = json.loads(record.read_text())
    body["segments"][0][2] ^= 1
    record.write_text(json.dumps(body))
    with pytest.raises(CheckpointingException, match=rf"the checksum record {record} \(of {shard}\) is damaged"):
        load(_request(), str(tmp_path))
    record.unlink()
    with pytest.raises(CheckpointingException, match=rf"{shard} has no checksum record \({record} is missing\)"):
        load(_request(), str(tmp_path))


def test_without_verification_a_damaged_tensor_loads_as_it_is(tmp_path):
    save(_state(), tmp_path)
    path = tmp_path / "__0_0.distcp"
    record = checksums.record_for(path, tmp_path)
    (start, length, _) = [segment for segment in record.segments if segment[1] >= BIG_WRITE][0]
    _flip(path, start + length // 2)  # inside the big tensor's values: still a readable file
    with verification(False):
        loaded = load(_request(), str(tmp_path))
    assert not torch.equal(loaded["big"], torch.ones(BIG))
    with pytest.raises(CheckpointingException, match=rf"{path} is corrupt: bytes {start}-{start + length - 1} "):
        load(_request(), str(tmp_path))


def test_a_checkpoint_without_checksums_loads_with_one_notice(tmp_path, caplog):
    save(_state(3.0), tmp_path)
    checksums.remove_records(tmp_path)  # as Megatron writes it
    with caplog.at_level(logging.WARNING, logger=checksums.__name__):
        assert load_common_state_dict(tmp_path)["iteration"] == 7
        assert torch.equal(load(_request(), str(tmp_path))["big"], torch.full(BIG, 3.0))
    notices = [r.getMessage() for r in caplog.records if r.name == checksums.__name__]
    assert notices == [
        f"checkpoint {tmp_path} has no checksums (written by Megatron or an earlier megatron-lite): "
        "loading it unverified"
    ]


def test_saving_again_into_a_directory_replaces_the_old_records(tmp_path):
    save(_state(1.0), tmp_path)
    save({"big": ShardedTensor.from_rank_offsets("big", torch.full(BIG, 5.0)), "iteration": 8}, tmp_path)
    request = {"big": _request()["big"]}
    assert torch.equal(load(request, str(tmp_path))["big"], torch.full(BIG, 5.0))


def test_reads_in_any_order_are_checked_and_a_partial_read_is_finished(tmp_path):
    path = tmp_path / "file"
    with open(path, "wb") as raw:
        stream = ChecksumStream(raw)
        for chunk in [b"head" * 10, bytes(range(256)) * 2048, b"tail" * 5]:
            stream.write(chunk)
        record = stream.record()
    data = path.read_bytes()
    assert [length for _, length, _ in record.segments] == [40, 256 * 2048, 20]
    with open(path, "rb") as raw:
        verified = VerifiedStream(raw, record, path)
        verified.seek(-20, io.SEEK_END)
        assert verified.read() == b"tail" * 5
        verified.seek(10)
        assert verified.read(60) == data[10:70]  # the rest of the head, then the large segment's start in place
        verified.finish()
    _flip(path, 1000)
    with open(path, "rb") as raw:
        verified = VerifiedStream(raw, record, path)
        assert verified.read(100) == path.read_bytes()[:100]
        with pytest.raises(ChecksumMismatchError, match=r"bytes 40-524327 \(of 524348\)"):
            verified.finish()  # the large segment was read only in part: the rest is checked at the end


def _async_save_then_damage(directory):
    queue = AsyncCallsQueue()
    rank = dist.get_rank()
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4, 300), float(rank)), (0, rank, 2)),
        "iteration": 1,
    }
    queue.schedule_async_request(save(state, directory, async_sharded_save=True))
    queue.close()
    dist.barrier()
    if rank == 0:
        _flip(checksums.Path(directory) / "__1_0.distcp", 100)
    dist.barrier()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 300), (0, rank, 2))}
    try:
        load(request, directory)
    except CheckpointingException as error:
        return str(error)
    return None


def test_an_async_save_records_checksums_that_the_load_checks(tmp_path):
    messages = run_distributed(2, _async_save_then_damage, str(tmp_path))
    for message in messages:  # rank 1 reads the damaged file; every rank stops
        assert f"{tmp_path}/__1_0.distcp is corrupt: bytes 0-" in message
    assert {p.name for p in (tmp_path / "checksums").iterdir()} == {
        "__0_0.distcp.json",
        "__1_0.distcp.json",
        ".metadata.json",
        "metadata.json.json",
    }
