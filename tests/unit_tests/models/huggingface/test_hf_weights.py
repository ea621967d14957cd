"""A safetensors file's header is checked before anything is read from it, and the error names the file: damaged
at its start, middle or end, truncated, or inconsistent (dtype and shape against the byte range). The converter's
own outputs pass the same check when they are written."""

import json
import struct

import pytest
import torch

from megatron.core.models.huggingface.families import UnsupportedHFModelError
from megatron.core.models.huggingface.weights import (
    HFCheckpointReader,
    validate_safetensors_header,
    write_safetensors_streamed,
)

TENSORS = {"a.weight": torch.arange(12.0).reshape(3, 4), "b.bias": torch.ones(5, dtype=torch.bfloat16)}


def _write(directory):
    entries = [(name, tensor.shape, tensor.dtype) for name, tensor in TENSORS.items()]
    (name,) = write_safetensors_streamed(str(directory), entries, TENSORS.items(), max_shard_bytes=1 << 30)
    return directory / name


def test_the_written_file_reads_back(tmp_path):
    path = _write(tmp_path)
    validate_safetensors_header(str(path))
    reader = HFCheckpointReader(str(tmp_path))
    assert torch.equal(reader.get("a.weight"), TENSORS["a.weight"])


def _header_length(path):
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.parametrize(
    "where, problem",
    [
        ("start", r"the header claims \d+ bytes, the file has \d+"),
        ("middle", r"the header is not JSON"),
        ("end", r"the header is not JSON"),
    ],
)
def test_a_damaged_header_is_one_line_naming_the_file(tmp_path, where, problem):
    path = _write(tmp_path)
    content = bytearray(path.read_bytes())
    length = _header_length(path)
    position = {"start": 7, "middle": 8 + length // 2, "end": 8 + length - 10}[where]
    content[position] ^= 0xFF
    path.write_bytes(bytes(content))
    with pytest.raises(UnsupportedHFModelError, match=rf"^{path} is not a valid safetensors file \({problem}") as e:
        HFCheckpointReader(str(tmp_path))
    assert "\n" not in str(e.value) and "download or convert it again" in str(e.value)


def test_a_truncated_file_is_named(tmp_path):
    path = _write(tmp_path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(UnsupportedHFModelError, match=r"tensor 'b.bias' has data_offsets \[48, 58\] outside"):
        HFCheckpointReader(str(tmp_path))
    path.write_bytes(b"\x01\x02")
    with pytest.raises(UnsupportedHFModelError, match="2 bytes, too short for the 8-byte header length"):
        validate_safetensors_header(str(path))


def _with_header(path, header):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(64))


@pytest.mark.parametrize(
    "entry, problem",
    [
        ({"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 48]}, r"\(F32 \[4, 4\]\) needs 64 bytes, .* span 48"),
        ({"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}, "unknown dtype 'Q7'"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, r"shape \[-1\], not a list of sizes"),
        ({"dtype": "F32", "shape": [1]}, r"lacks dtype, shape or a \[begin, end\] data_offsets"),
    ],
)
def test_an_inconsistent_entry_is_named(tmp_path, entry, problem):
    path = tmp_path / "model.safetensors"
    _with_header(path, {"w": entry})
    with pytest.raises(UnsupportedHFModelError, match=rf"{path} is not a valid safetensors file \(tensor 'w' "):
        validate_safetensors_header(str(path))
    with pytest.raises(UnsupportedHFModelError, match=problem):
        validate_safetensors_header(str(path))
    _with_header(path, [1, 2])
    with pytest.raises(UnsupportedHFModelError, match="the header is not a JSON object"):
        validate_safetensors_header(str(path))
