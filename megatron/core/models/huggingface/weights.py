"""The few tensor transforms between HF and Megatron layouts, and safetensors reading and (streamed) writing.

Every transform is a pure reshuffle (views, cat, transpose, zero padding of vocabulary rows), so a round trip
HF -> Megatron -> HF gives back every tensor bit for bit. ``to_megatron(transform, hf_tensors, ...)`` and
``to_hf(transform, tensor, ...)`` are each other's inverse.
"""

import json
import os
import struct
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.core.models.huggingface.families import ModelSettings, UnsupportedHFModelError

# ---- transforms ------------------------------------------------------------------------------------------------------


def _qkv_to_megatron(q, k, v, s: ModelSettings) -> torch.Tensor:
    """HF's separate q [heads*d], k, v [groups*d] (rows) -> Megatron's fused rows, per query group g:
    ``[the q heads of g | k_g | v_g]``."""
    groups, rest = s.num_query_groups, q.shape[1:]
    parts = [x.reshape(groups, -1, *rest) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _qkv_to_hf(qkv, s: ModelSettings) -> List[torch.Tensor]:
    groups, rest, d = s.num_query_groups, qkv.shape[1:], s.kv_channels
    heads_per_group = s.num_attention_heads // groups
    grouped = qkv.reshape(groups, (heads_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * d, d, d], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]


def _pad_vocab(weight, padded_vocab_size: int) -> torch.Tensor:
    if weight.shape[0] > padded_vocab_size:
        raise UnsupportedHFModelError(
            f"vocabulary of {weight.shape[0]} rows does not fit the model's {padded_vocab_size}"
        )
    if weight.shape[0] == padded_vocab_size:
        return weight  # already a multiple: no copy of the largest tensor
    padding = weight.new_zeros(padded_vocab_size - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, padding])


def to_megatron(transform: str, hf: Sequence[torch.Tensor], s: ModelSettings, padded_vocab_size: int):
    """The Megatron tensor (full, unsharded) made from the HF tensors of one rule."""
    if transform == "copy":
        return hf[0]
    if transform == "transpose":  # GPT-2 Conv1D stores [in, out]
        return hf[0].t().contiguous()
    if transform == "cat":  # SwiGLU fc1 = [gate; up]
        return torch.cat(list(hf))
    if transform == "qkv":
        return _qkv_to_megatron(*hf, s)
    if transform == "fused_qkv":  # GPT-2 c_attn bias [Q | K | V]
        return _qkv_to_megatron(*hf[0].chunk(3), s)
    if transform == "fused_qkv_conv1d":  # GPT-2 c_attn weight [in, Q | K | V]
        return _qkv_to_megatron(*hf[0].t().chunk(3), s)
    if transform == "vocab":
        return _pad_vocab(hf[0], padded_vocab_size)
    raise ValueError(f"unknown weight transform {transform!r}")


def to_hf(transform: str, tensor: torch.Tensor, s: ModelSettings) -> List[torch.Tensor]:
    """The HF tensors of one rule from the full Megatron tensor (inverse of :func:`to_megatron`)."""
    if transform == "copy":
        return [tensor]
    if transform == "transpose":
        return [tensor.t().contiguous()]
    if transform == "cat":
        return [x.contiguous() for x in tensor.chunk(2)]
    if transform == "qkv":
        return _qkv_to_hf(tensor, s)
    if transform == "fused_qkv":
        return [torch.cat(_qkv_to_hf(tensor, s))]
    if transform == "fused_qkv_conv1d":
        return [torch.cat(_qkv_to_hf(tensor, s)).t().contiguous()]
    if transform == "vocab":
        return [tensor[: s.vocab_size].contiguous()]
    raise ValueError(f"unknown weight transform {transform!r}")


# ---- tensor-parallel slices ------------------------------------------------------------------------------------------


def tensor_parallel_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's piece of ``full`` for ``param``: the partition dimension cut into ``stride * tp`` blocks, rank r
    keeping blocks r, r + tp, ... (the layout ColumnParallelLinear's ``stride`` describes)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    blocks = full.chunk(stride * tp_size, dim=dim)
    return torch.cat([blocks[s * tp_size + tp_rank] for s in range(stride)], dim=dim)


def tensor_parallel_sections_slice(
    full: torch.Tensor, sections: Sequence[int], tp_rank: int, tp_size: int
) -> torch.Tensor:
    """Rank ``tp_rank``'s rows of ``full`` whose axis 0 concatenates segments of the given sizes, each split over TP
    on its own (the Mamba in_proj's z|x|B|C|dt): piece ``tp_rank`` of every segment, in order."""
    if sum(sections) != full.shape[0]:
        raise UnsupportedHFModelError(f"a tensor of {full.shape[0]} rows cannot hold segments {list(sections)}")
    segments = torch.split(full, list(sections), dim=0)
    return torch.cat([segment.chunk(tp_size, dim=0)[tp_rank] for segment in segments], dim=0)


# ---- reading HF checkpoints ------------------------------------------------------------------------------------------

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


# Bytes per element of each safetensors dtype name.
_SAFETENSORS_ELEMENT_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def validate_safetensors_header(path: str) -> None:
    """Check a safetensors file's header before anything is read from it: its length fits the file, it is a JSON
    object, and every tensor's dtype, shape and byte range agree and lie within the data. Raises
    :class:`UnsupportedHFModelError` naming the file (safetensors' own error names neither file nor fix)."""

    def bad(problem: str) -> UnsupportedHFModelError:
        return UnsupportedHFModelError(
            f"{path} is not a valid safetensors file ({problem}); it is damaged or truncated: download or convert "
            "it again"
        )

    size = os.path.getsize(path)
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise bad(f"{size} bytes, too short for the 8-byte header length")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
            raise bad(f"the header claims {header_bytes} bytes, the file has {size - 8} after the length")
        try:
            header = json.loads(file.read(header_bytes))
        except (ValueError, UnicodeDecodeError) as error:
            raise bad(f"the header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data_bytes = size - 8 - header_bytes
    for name, entry in header.items():
        if name != "__metadata__":
            _check_safetensors_entry(name, entry, data_bytes, bad)


def _check_safetensors_entry(name, entry, data_bytes: int, bad) -> None:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise bad(f"tensor {name!r} lacks dtype, shape or a [begin, end] data_offsets") from None
    if dtype not in _SAFETENSORS_ELEMENT_BYTES:
        raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise bad(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_bytes):
        raise bad(f"tensor {name!r} has data_offsets [{begin}, {end}] outside the {data_bytes} data bytes")
    expected = torch.Size(shape).numel() * _SAFETENSORS_ELEMENT_BYTES[dtype]
    if end - begin != expected:
        raise bad(f"tensor {name!r} ({dtype} {shape}) needs {expected} bytes, its data_offsets span {end - begin}")


class HFCheckpointReader:
    """The tensors of a local HF directory (``model.safetensors`` or shards named by
    ``model.safetensors.index.json``), memory-mapped and read one tensor at a time. Pickled ``.bin`` files are
    refused: they would be unpickled, and may run code."""

    def __init__(self, directory: str, optional_prefix: str = ""):
        from safetensors import safe_open

        self.directory = directory
        self._safe_open = safe_open
        self._validated: set = set()
        index_path = os.path.join(directory, SAFETENSORS_INDEX)
        single_path = os.path.join(directory, SAFETENSORS_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as file:
                weight_map = json.load(file).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UnsupportedHFModelError(f"{index_path} has no 'weight_map'")
        elif os.path.isfile(single_path):
            with self._open(SAFETENSORS_FILE) as handle:
                weight_map = {name: SAFETENSORS_FILE for name in handle.keys()}
        else:
            found = sorted(os.listdir(directory)) if os.path.isdir(directory) else "no such directory"
            raise UnsupportedHFModelError(
                f"{directory}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (found: {found}); only safetensors "
                "checkpoints are read (save with save_pretrained(..., safe_serialization=True))"
            )
        # Writers of some families leave off a prefix (Hub GPT-2 files have no "transformer."): names are
        # normalised to the prefixed form the family tables use.
        self._file_of: Dict[str, str] = {}
        self._stored_name: Dict[str, str] = {}
        for name, file_name in weight_map.items():
            full = name
            if optional_prefix and not name.startswith(optional_prefix) and not name.startswith("lm_head."):
                full = optional_prefix + name
            self._file_of[full] = file_name
            self._stored_name[full] = name

    def _open(self, file_name: str):
        path = os.path.join(self.directory, file_name)
        if not os.path.isfile(path):
            raise UnsupportedHFModelError(f"{path} (named by {SAFETENSORS_INDEX}) does not exist")
        if path not in self._validated:
            validate_safetensors_header(path)
            self._validated.add(path)
        return self._safe_open(path, framework="pt", device="cpu")

    def names(self) -> List[str]:
        return list(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        """One tensor, copied out of the mapped file. The file is mapped for this read only: pages of tensors read
        earlier do not stay resident, so memory stays near one tensor however large the checkpoint."""
        if name not in self._file_of:
            raise UnsupportedHFModelError(f"{self.directory}: tensor {name!r} is missing")
        with self._open(self._file_of[name]) as handle:
            return handle.get_tensor(self._stored_name[name])


# ---- writing safetensors, streamed -----------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def plan_shards(entries: Sequence[Tuple[str, torch.Size, torch.dtype]], max_shard_bytes: int) -> List[List[int]]:
    """Indices of ``entries`` per output file, in order, each file at most ``max_shard_bytes`` (a single larger
    tensor gets a file of its own)."""
    shards, current, size = [], [], 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        shards.append(current)
    return shards


class SafetensorsStreamWriter:
    """Writes one safetensors file whose header (names, dtypes, shapes) is known before any data: the header first,
    then each tensor's bytes as it arrives, in header order, so only the tensor being written is in memory."""

    def __init__(self, path: str, entries: Sequence[Tuple[str, torch.Size, torch.dtype]]):
        self.path = path
        self.expected = [name for name, _, _ in entries]
        header, offset = {}, 0
        self.shapes = {}
        for name, shape, dtype in entries:
            if dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}, which safetensors cannot store")
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self.shapes[name] = (torch.Size(shape), dtype)
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self.file = open(path + ".tmp", "wb")
        self.file.write(struct.pack("<Q", len(encoded)))
        self.file.write(encoded)
        self.position = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.expected[self.position]
        if name != expected:
            raise RuntimeError(f"{self.path}: got tensor {name!r} where {expected!r} was planned")
        if (tensor.shape, tensor.dtype) != self.shapes[name]:
            raise RuntimeError(
                f"{self.path}: tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, planned "
                f"{tuple(self.shapes[name][0])} {self.shapes[name][1]}"
            )
        data = tensor.detach().contiguous().cpu()
        if data.numel():  # the tensor's own bytes, without a copy
            self.file.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self.position += 1

    def close(self) -> None:
        if self.position != len(self.expected):
            self.file.close()
            raise RuntimeError(f"{self.path}: {len(self.expected) - self.position} planned tensors never arrived")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        validate_safetensors_header(self.path + ".tmp")  # the header as read back: cheap, before it is in place
        os.replace(self.path + ".tmp", self.path)


def write_safetensors_streamed(
    directory: str,
    entries: Sequence[Tuple[str, torch.Size, torch.dtype]],
    tensors: Iterable[Tuple[str, torch.Tensor]],
    max_shard_bytes: int,
) -> List[str]:
    """Write ``tensors`` (arriving in ``entries`` order) as ``model.safetensors``, or, above ``max_shard_bytes``, as
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``. Returns the files written."""
    shards = plan_shards(entries, max_shard_bytes)
    names = (
        [SAFETENSORS_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    iterator: Iterator[Tuple[str, torch.Tensor]] = iter(tensors)
    weight_map, total = {}, 0
    for file_name, indices in zip(names, shards):
        shard_entries = [entries[i] for i in indices]
        writer = SafetensorsStreamWriter(os.path.join(directory, file_name), shard_entries)
        for _ in indices:
            name, tensor = next(iterator)
            writer.write(name, tensor)
            weight_map[name] = file_name
            total += tensor.numel() * tensor.element_size()
        writer.close()
    if next(iterator, None) is not None:
        raise RuntimeError("more tensors arrived than were planned")
    if len(shards) > 1:
        with open(os.path.join(directory, SAFETENSORS_INDEX), "w") as file:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file, indent=2)
    return names


def parse_size(text: Optional[str]) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (``--max-shard-size``)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    value = str(text).strip().upper()
    for unit, factor in units.items():
        if value.endswith(unit) and value[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(value[: -len(unit)]) * factor)
    if value.isdigit():
        return int(value)
    raise ValueError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB or a number of bytes")
