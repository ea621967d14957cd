"""IndexedDataset / IndexedDatasetBuilder: byte vectors of the Megatron format, round trips, and every bad file."""

import logging
import os
import pickle
import struct

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetFormatError,
    get_bin_path,
    get_idx_path,
)

HEADER_82_BYTE_VECTOR = bytes.fromhex(
    "4d4d4944494458 0000"  # magic
    "0100000000000000"  # version 1
    "08"  # uint16
    "0200000000000000"  # 2 sequences
    "0300000000000000"  # 3 document-index entries
    "03000000 02000000"  # lengths
    "0000000000000000 0600000000000000"  # byte pointers
    "0000000000000000 0100000000000000 0200000000000000"  # document indices
)


def build(prefix, documents, dtype=np.uint16, multimodal=False, modes=None):
    """Write `documents` (each a list of sequences) with add_document; returns the prefix."""
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype, multimodal=multimodal)
    for doc_number, document in enumerate(documents):
        tokens = [token for sequence in document for token in sequence]
        doc_modes = None if modes is None else modes[doc_number]
        builder.add_document(np.array(tokens, dtype=np.int64), [len(s) for s in document], modes=doc_modes)
    builder.finalize(get_idx_path(prefix))
    return prefix


def read_bytes(path):
    with open(path, "rb") as file:
        return file.read()


def header(dtype_code, sequences, document_entries, magic=b"MMIDIDX\x00\x00", version=1):
    return struct.pack("<9sQBQQ", magic, version, dtype_code, sequences, document_entries)


# --- byte vectors -------------------------------------------------------------------------------------------------


def test_reference_vector_two_uint16_documents(tmp_path):
    prefix = build(str(tmp_path / "ref"), [[[1, 2, 3]], [[4, 5]]])
    assert read_bytes(prefix + ".bin") == bytes.fromhex("01000200030004000500")
    assert read_bytes(prefix + ".idx") == HEADER_82_BYTE_VECTOR
    assert len(HEADER_82_BYTE_VECTOR) == 82


def test_int32_vector(tmp_path):
    prefix = build(str(tmp_path / "i32"), [[[1, 2, 3]], [[70000]]], dtype=np.int32)
    assert read_bytes(prefix + ".bin") == struct.pack("<4i", 1, 2, 3, 70000)
    expected_idx = header(4, 2, 3) + struct.pack("<2i", 3, 1) + struct.pack("<2q", 0, 12) + struct.pack("<3q", 0, 1, 2)
    assert read_bytes(prefix + ".idx") == expected_idx


def test_several_sequences_per_document_vector(tmp_path):
    prefix = build(str(tmp_path / "sent"), [[[1, 2], [3, 4, 5]], [[6]]])
    assert read_bytes(prefix + ".bin") == struct.pack("<6H", 1, 2, 3, 4, 5, 6)
    expected_idx = (
        header(8, 3, 3) + struct.pack("<3i", 2, 3, 1) + struct.pack("<3q", 0, 4, 10) + struct.pack("<3q", 0, 2, 3)
    )
    assert read_bytes(prefix + ".idx") == expected_idx


def test_empty_documents_vector_and_read(tmp_path):
    prefix = build(str(tmp_path / "empty"), [[], [[7, 8]], [], []])
    assert read_bytes(prefix + ".bin") == struct.pack("<2H", 7, 8)
    expected_idx = header(8, 1, 5) + struct.pack("<i", 2) + struct.pack("<q", 0) + struct.pack("<5q", 0, 0, 1, 1, 1)
    assert read_bytes(prefix + ".idx") == expected_idx
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 1 and dataset[0].tolist() == [7, 8]
    assert dataset.document_indices.tolist() == [0, 0, 1, 1, 1]


def test_empty_dataset_round_trip(tmp_path):
    prefix = build(str(tmp_path / "nothing"), [])
    assert read_bytes(prefix + ".bin") == b""
    assert read_bytes(prefix + ".idx") == header(8, 0, 1) + struct.pack("<q", 0)
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 0 and dataset[:] == []


def test_multimodal_vector_and_reads(tmp_path):
    prefix = build(str(tmp_path / "mm"), [[[1, 2], [3]], [[4]]], multimodal=True, modes=[[0, 1], [2]])
    expected_idx = (
        header(8, 3, 3)
        + struct.pack("<3i", 2, 1, 1)
        + struct.pack("<3q", 0, 4, 6)
        + struct.pack("<3q", 0, 2, 3)
        + struct.pack("<3b", 0, 1, 2)
    )
    assert read_bytes(prefix + ".idx") == expected_idx
    dataset = IndexedDataset(prefix, multimodal=True)
    tokens, mode = dataset[1]
    assert tokens.tolist() == [3] and mode == 1
    sequences, modes = dataset[0:3]
    assert [s.tolist() for s in sequences] == [[1, 2], [3], [4]] and modes.tolist() == [0, 1, 2]
    tokens, mode = dataset.get(0, offset=1)
    assert tokens.tolist() == [2] and mode == 0
    assert dataset.sequence_modes.tolist() == [0, 1, 2]


def test_add_item_and_end_document_match_add_document(tmp_path):
    by_document = build(str(tmp_path / "doc"), [[[1, 2], [3]], [[4, 5, 6]]])
    builder = IndexedDatasetBuilder(str(tmp_path / "item.bin"), dtype=np.uint16)
    builder.add_item(np.array([1, 2]))
    builder.add_item([3])
    builder.end_document()
    builder.add_item(np.array([4, 5, 6], dtype=np.int32))
    builder.end_document()
    builder.finalize(str(tmp_path / "item.idx"))
    assert read_bytes(str(tmp_path / "item.bin")) == read_bytes(by_document + ".bin")
    assert read_bytes(str(tmp_path / "item.idx")) == read_bytes(by_document + ".idx")


def test_builder_accepts_cpu_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    builder = IndexedDatasetBuilder(str(tmp_path / "t.bin"), dtype=np.uint16)
    builder.add_item(torch.tensor([1, 2, 3]))
    builder.end_document()
    builder.add_document(torch.tensor([4, 5], dtype=torch.int32), torch.tensor([2]))
    builder.finalize(str(tmp_path / "t.idx"))
    assert read_bytes(str(tmp_path / "t.idx")) == HEADER_82_BYTE_VECTOR


def test_add_index_merges_byte_identically(tmp_path):
    first = [[[1, 2], [3]], []]
    second = [[[4]], [[5, 6, 7]]]
    part_a = build(str(tmp_path / "a"), first)
    part_b = build(str(tmp_path / "b"), second)
    direct = build(str(tmp_path / "direct"), first + second)
    builder = IndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.uint16)
    builder.add_index(part_a)
    builder.add_index(part_b)
    builder.finalize(str(tmp_path / "merged.idx"))
    assert read_bytes(str(tmp_path / "merged.bin")) == read_bytes(direct + ".bin")
    assert read_bytes(str(tmp_path / "merged.idx")) == read_bytes(direct + ".idx")


def test_add_index_multimodal_keeps_modes(tmp_path):
    part = build(str(tmp_path / "p"), [[[1], [2]]], multimodal=True, modes=[[3, 4]])
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16, multimodal=True)
    builder.add_document([9], [1], modes=[5])
    builder.add_index(part)
    builder.finalize(str(tmp_path / "m.idx"))
    merged = IndexedDataset(str(tmp_path / "m"), multimodal=True)
    assert merged.sequence_modes.tolist() == [5, 3, 4]
    assert merged.document_indices.tolist() == [0, 1, 3]


# --- round trips ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16])
@pytest.mark.parametrize("use_mmap", [True, False])
def test_round_trip_every_dtype(tmp_path, dtype, use_mmap):
    rng = np.random.default_rng(0)
    documents = [
        [list(rng.integers(0, 100, size=int(rng.integers(0, 6)))) for _ in range(int(rng.integers(0, 4)))]
        for _ in range(30)
    ]
    prefix = build(str(tmp_path / "rt"), documents, dtype=dtype)
    dataset = IndexedDataset(prefix, mmap=use_mmap)
    sequences = [sequence for document in documents for sequence in document]
    assert len(dataset) == len(sequences)
    assert dataset.dtype == dtype
    for i, sequence in enumerate(sequences):
        assert dataset[i].dtype == dtype and dataset[i].tolist() == sequence
    assert [s.tolist() for s in dataset[2:9]] == sequences[2:9]
    assert dataset[-1].tolist() == sequences[-1]
    assert dataset.sequence_lengths.tolist() == [len(s) for s in sequences]
    itemsize = np.dtype(dtype).itemsize
    assert dataset.sequence_pointers.tolist() == list(np.cumsum([0] + [len(s) * itemsize for s in sequences])[:-1])
    counts = np.cumsum([0] + [len(document) for document in documents])
    assert dataset.document_indices.tolist() == counts.tolist()


@pytest.mark.parametrize("use_mmap", [True, False])
def test_get_offset_and_length(tmp_path, use_mmap):
    prefix = build(str(tmp_path / "g"), [[[10, 11, 12, 13, 14]], [[20, 21]]])
    dataset = IndexedDataset(prefix, mmap=use_mmap)
    assert dataset.get(0, offset=1, length=3).tolist() == [11, 12, 13]
    assert dataset.get(0, offset=3).tolist() == [13, 14]
    assert dataset.get(1, offset=2).tolist() == []
    assert dataset.get(np.int64(1)).tolist() == [20, 21]


def test_mmap_reads_are_zero_copy_views(tmp_path):
    dataset = IndexedDataset(build(str(tmp_path / "z"), [[[1, 2, 3]]]))
    sequence = dataset[0]
    assert not sequence.flags.owndata and not sequence.flags.writeable


def test_pickle_reopens_the_files(tmp_path):
    dataset = IndexedDataset(build(str(tmp_path / "pk"), [[[1, 2]], [[3]]]), mmap=False)
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone.mmap is False and clone[1].tolist() == [3]


def test_exists(tmp_path):
    prefix = build(str(tmp_path / "e"), [[[1]]])
    assert IndexedDataset.exists(prefix)
    os.remove(prefix + ".bin")
    assert not IndexedDataset.exists(prefix)
    assert not IndexedDataset.exists(str(tmp_path / "never"))


def test_dtype_codes_and_sizes():
    assert [DType.code_from_dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32)] == [1, 2, 3, 4]
    assert [DType.code_from_dtype(t) for t in (np.int64, np.float64, np.float32, np.uint16)] == [5, 6, 7, 8]
    assert DType.dtype_from_code(8) is np.uint16 and DType.dtype_from_code(4) is np.int32
    assert DType.size(8) == 2 and DType.size(np.int64) == 8 and DType.size(np.dtype("float32")) == 4
    assert DType.optimal_dtype(65499) is np.uint16
    assert DType.optimal_dtype(65500) is np.int32
    assert DType.optimal_dtype(None) is np.int32
    with pytest.raises(ValueError, match="unknown token dtype code 9"):
        DType.dtype_from_code(9)
    with pytest.raises(ValueError, match="float16.*cannot be stored"):
        DType.code_from_dtype(np.float16)
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetBuilder("unused.bin", dtype=np.uint32)


# --- reading errors ------------------------------------------------------------------------------------------------


@pytest.fixture
def good_prefix(tmp_path):
    return build(str(tmp_path / "good"), [[[1, 2, 3]], [[4, 5]]])


def overwrite(path, data):
    with open(path, "wb") as file:
        file.write(data)


def test_missing_files_name_the_path(good_prefix):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.idx: indexed dataset index"):
        IndexedDataset(good_prefix + "nowhere")
    os.remove(good_prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"good\.bin: indexed dataset data"):
        IndexedDataset(good_prefix)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda idx: idx[:20], r"good\.idx: truncated index: 20 bytes, shorter than the 34-byte header"),
        (lambda idx: b"NOTMMIDX\x00" + idx[9:], r"good\.idx: not a Megatron indexed dataset index \(magic"),
        (lambda idx: idx[:9] + struct.pack("<Q", 2) + idx[17:], r"good\.idx: index version 2 is not supported"),
        (lambda idx: idx[:17] + b"\x09" + idx[18:], r"good\.idx: unknown token dtype code 9"),
        (lambda idx: idx[:17] + b"\x00" + idx[18:], r"good\.idx: unknown token dtype code 0"),
        (lambda idx: idx[:-8], r"good\.idx: truncated index: 74 bytes, but its header describes 82"),
        (lambda idx: idx[:18] + struct.pack("<Q", 2**40) + idx[26:], r"good\.idx: truncated index"),
        (lambda idx: idx + b"\x00" * 5, r"good\.idx: 5 unexpected bytes after the last array"),
        (lambda idx: idx + b"\x00" * 2, r"good\.idx: index ends with 2 bytes of sequence modes.*multimodal=True"),
        (lambda idx: idx[:26] + struct.pack("<Q", 0) + idx[34:], r"good\.idx: document index has 0 entries"),
        (lambda idx: idx[:-8] + struct.pack("<q", 1), r"good\.idx: inconsistent counts.*from 0 to 1.*count 2"),
        (lambda idx: idx[:-24] + struct.pack("<q", 1) + idx[-16:], r"good\.idx: inconsistent counts.*from 1 to 2"),
    ],
    ids=[
        "short-header",
        "magic",
        "version",
        "dtype-code-9",
        "dtype-code-0",
        "truncated-arrays",
        "absurd-sequence-count",
        "trailing-bytes",
        "looks-multimodal",
        "no-document-index",
        "last-document-index",
        "first-document-index",
    ],
)
def test_corrupt_index_raises_naming_the_file(good_prefix, corrupt, message):
    idx_path = good_prefix + ".idx"
    overwrite(idx_path, corrupt(read_bytes(idx_path)))
    with pytest.raises(IndexedDatasetFormatError, match=message):
        IndexedDataset(good_prefix)


def test_multimodal_flag_on_a_plain_index(good_prefix):
    with pytest.raises(IndexedDatasetFormatError, match=r"good\.idx: index has no sequence modes.*multimodal=False"):
        IndexedDataset(good_prefix, multimodal=True)


def test_bin_shorter_than_index_says(good_prefix):
    overwrite(good_prefix + ".bin", read_bytes(good_prefix + ".bin")[:-2])
    message = r"good\.bin: data file has 8 bytes but .*good\.idx describes 10"
    with pytest.raises(IndexedDatasetFormatError, match=message):
        IndexedDataset(good_prefix)


def test_bin_longer_than_index_says_warns(good_prefix, caplog):
    overwrite(good_prefix + ".bin", read_bytes(good_prefix + ".bin") + b"\x00\x00")
    with caplog.at_level(logging.WARNING):
        dataset = IndexedDataset(good_prefix)
    assert "2 bytes after the last sequence" in caplog.text
    assert dataset[1].tolist() == [4, 5]


@pytest.mark.parametrize("use_mmap", [True, False])
def test_pointer_outside_bin_raises_on_read(good_prefix, use_mmap):
    idx = bytearray(read_bytes(good_prefix + ".idx"))
    idx[42:50] = struct.pack("<q", 1000)  # first sequence's pointer, far past the 10-byte .bin
    overwrite(good_prefix + ".idx", bytes(idx))
    dataset = IndexedDataset(good_prefix, mmap=use_mmap)
    with pytest.raises(IndexedDatasetFormatError, match=r"good\.idx: sequence 0 \(byte offset 1000, 3 tokens\) lies"):
        dataset[0]
    assert dataset[1].tolist() == [4, 5]


def test_negative_length_raises_on_read(good_prefix):
    idx = bytearray(read_bytes(good_prefix + ".idx"))
    idx[34:38] = struct.pack("<i", -3)
    overwrite(good_prefix + ".idx", bytes(idx))
    with pytest.raises(IndexedDatasetFormatError, match=r"good\.idx: sequence 0 has a negative length -3"):
        IndexedDataset(good_prefix)[0]


def test_bad_read_requests(good_prefix):
    dataset = IndexedDataset(good_prefix)
    with pytest.raises(IndexError, match=r"sequence index 2 out of range .*\(2 sequences\)"):
        dataset[2]
    with pytest.raises(IndexError, match=r"tokens \[2, 4\) are outside sequence 0 .* 3 tokens"):
        dataset.get(0, offset=2, length=2)
    with pytest.raises(IndexError, match=r"tokens \[-1, 2\) are outside"):
        dataset.get(0, offset=-1, length=3)
    with pytest.raises(ValueError, match="must be contiguous"):
        dataset[::2]
    with pytest.raises(TypeError, match="not str"):
        dataset["0"]


# --- builder errors and crash safety ------------------------------------------------------------------------------


def test_builder_validates_documents(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "v.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match=r"lengths \[2\] \(sum 2\) must be non-negative and add up to the 3 tokens"):
        builder.add_document([1, 2, 3], [2])
    with pytest.raises(ValueError, match="must be non-negative"):
        builder.add_document([1], [-1, 2])
    with pytest.raises(ValueError, match="builder is not multimodal"):
        builder.add_document([1], [1], modes=[0])
    with pytest.raises(ValueError, match=r"outside \[0, 65535\] cannot be stored as uint16 .*v\.bin"):
        builder.add_document([70000], [1])
    with pytest.raises(ValueError, match="outside"):
        builder.add_item([-1])
    with pytest.raises(ValueError, match="float64 cannot be stored as uint16"):
        builder.add_item(np.array([1.5]))
    builder.add_document([1, 2], [2])  # the failures above left nothing behind
    builder.finalize(str(tmp_path / "v.idx"))
    assert IndexedDataset(str(tmp_path / "v"))[0].tolist() == [1, 2]
    assert read_bytes(str(tmp_path / "v.bin")) == struct.pack("<2H", 1, 2)


def test_builder_validates_modes(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), multimodal=True)
    with pytest.raises(ValueError, match="1 modes given for 2 sequences"):
        builder.add_document([1, 2], [1, 1], modes=[0])
    builder.abort()


def test_finalize_requires_closed_documents_and_runs_once(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "f.bin"))
    builder.add_item([1])
    with pytest.raises(ValueError, match="1 sequences were added after the last document boundary"):
        builder.finalize(str(tmp_path / "f.idx"))
    builder.end_document()
    builder.finalize(str(tmp_path / "f.idx"))
    with pytest.raises(ValueError, match=r"f\.bin was already finalized or aborted"):
        builder.finalize(str(tmp_path / "f.idx"))


def test_add_index_dtype_mismatch(tmp_path, good_prefix):
    builder = IndexedDatasetBuilder(str(tmp_path / "wide.bin"), dtype=np.int32)
    with pytest.raises(ValueError, match=r"good\.idx holds uint16 tokens but this builder writes int32"):
        builder.add_index(good_prefix)
    builder.abort()


def test_add_index_rejects_non_contiguous_source(tmp_path, good_prefix):
    idx = bytearray(read_bytes(good_prefix + ".idx"))
    idx[50:58] = struct.pack("<q", 4)  # second sequence starts inside the first
    overwrite(good_prefix + ".idx", bytes(idx))
    builder = IndexedDatasetBuilder(str(tmp_path / "c.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetFormatError, match=r"good\.idx: sequences are not stored back to back"):
        builder.add_index(good_prefix)
    builder.abort()


def test_nothing_at_final_paths_before_finalize(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "late.bin"))
    builder.add_document([1, 2], [2])
    assert not os.path.exists(tmp_path / "late.bin")
    assert [name for name in os.listdir(tmp_path) if name.startswith("late.bin.partial-")]
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_finalize_replaces_an_existing_pair(tmp_path):
    prefix = build(str(tmp_path / "same"), [[[1, 2, 3]]])
    build(prefix, [[[9]], [[8]]])
    dataset = IndexedDataset(prefix)
    assert [s.tolist() for s in dataset[:]] == [[9], [8]]
    assert sorted(os.listdir(tmp_path)) == ["same.bin", "same.idx"]


def test_failed_finalize_leaves_old_pair_or_nothing(tmp_path, good_prefix):
    builder = IndexedDatasetBuilder(good_prefix + ".bin", dtype=np.uint16)
    builder.add_document([7], [1])
    with pytest.raises(FileNotFoundError):
        builder.finalize(str(tmp_path / "no_such_dir" / "good.idx"))
    assert IndexedDataset(good_prefix)[0].tolist() == [1, 2, 3]  # the old pair is untouched
    assert sorted(os.listdir(tmp_path)) == ["good.bin", "good.idx"]  # and no partial files remain
