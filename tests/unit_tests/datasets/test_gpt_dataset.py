"""GPTDataset: indices identical to the spec's loops, samples, masks, padding, the index cache, MockGPTDataset."""

import hashlib
import os

import numpy as np
import pytest
import torch

from megatron.core.datasets import gpt_dataset, index_cache, index_helpers
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
    _get_ltor_masks_and_position_ids,
)
from megatron.core.datasets.index_cache import IndexCacheError
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split
from tests.unit_tests.datasets.corpus import EOD, PAD, TokenizerWithoutPad, ToyTokenizer, random_documents, write_corpus
from tests.unit_tests.datasets.reference_indices import reference_gpt_indices, reference_num_epochs


def make_config(tmp_path, prefix="corpus", **overrides):
    settings = dict(
        random_seed=1234,
        sequence_length=16,
        blend=([str(tmp_path / prefix)], None),
        split="1",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=ToyTokenizer(),
    )
    settings.update(overrides)
    return GPTDatasetConfig(**settings)


def make_dataset(tmp_path, documents, num_samples, split=Split.train, indices=None, **config_overrides):
    prefix = str(tmp_path / "corpus")
    if not IndexedDataset.exists(prefix):
        write_corpus(prefix, documents)
    low_level = IndexedDataset(prefix)
    if indices is None:
        indices = np.arange(len(documents), dtype=np.int32)
    config = make_config(tmp_path, **config_overrides)
    return GPTDataset(low_level, prefix, indices, num_samples, split, config)


def token_stream_sample(shuffled_documents, row_begin, sequence_length, extra, pad):
    """Reference text of a sample: the stream of shuffled documents from the sample's start, padded."""
    stream = [token for document in shuffled_documents for token in document]
    position, offset = row_begin
    start = sum(len(document) for document in shuffled_documents[:position]) + offset
    text = stream[start : start + sequence_length + extra]
    return text + [pad] * (sequence_length + extra - len(text))


@pytest.mark.parametrize("trial", range(60))
def test_index_helpers_match_the_reference_loops(trial, monkeypatch):
    rng = np.random.default_rng(trial)
    sizes = rng.integers(0, 30, int(rng.integers(1, 40))).astype(np.int32)
    sizes[-1] += 1  # at least one token in the split
    indices = np.arange(int(rng.integers(0, len(sizes))), len(sizes), dtype=np.int32)
    tokens_per_epoch = int(sizes[indices].sum())
    sequence_length = int(rng.integers(1, 20))
    extra = trial % 2
    seed = int(rng.integers(0, 2**31))
    num_samples = None if trial % 5 == 0 else int(rng.integers(0, 4 * tokens_per_epoch // sequence_length + 2))
    drop_last = trial % 3 != 0
    # Tiny chunks make the vectorised builder cross chunk boundaries inside and between samples.
    monkeypatch.setattr(index_helpers, "_DOCUMENTS_PER_CHUNK", int(rng.integers(1, 8)))

    documents, rows, shuffle, separate = reference_gpt_indices(
        sizes, indices, num_samples, sequence_length, extra, seed, drop_last
    )

    num_epochs = reference_num_epochs(tokens_per_epoch, num_samples, sequence_length, extra)
    rng_state = np.random.RandomState(seed)
    document_index = index_helpers.build_document_index(indices, num_epochs, rng_state, separate)
    sample_index = index_helpers.build_sample_index(
        sizes, document_index, sequence_length, num_epochs, tokens_per_epoch, drop_last, extra
    )
    total = sample_index.shape[0] - 1
    first = ((num_epochs - 1) * tokens_per_epoch - extra) // sequence_length if separate else total
    shuffle_index = index_helpers.build_shuffle_index(first, total, rng_state)

    assert document_index.dtype == np.int32 and document_index.tolist() == documents
    assert sample_index.dtype == np.int32 and [tuple(row) for row in sample_index.tolist()] == rows
    assert shuffle_index.dtype == np.uint32 and shuffle_index.tolist() == shuffle


# Corpus of 60 documents; with sequence_length 16 one epoch holds `samples_per_epoch` samples.
DOCUMENTS = random_documents(seed=7, count=60)
TOKENS = sum(len(d) for d in DOCUMENTS)


@pytest.mark.parametrize(
    "case, num_samples, extra, split, expect_separate",
    [
        ("one epoch (num_samples None)", None, True, Split.train, False),
        ("one epoch", 10, True, Split.train, False),
        ("three epochs, final epoch large", ((3 * TOKENS - 1) // 16) - 2, True, Split.train, False),
        ("separate final epoch", ((2 * TOKENS - 1) // 16) + 3, True, Split.train, True),
        ("no extra token, separate final epoch", ((2 * TOKENS) // 16) + 3, False, Split.train, True),
        ("validation keeps the partial sample", 2 * TOKENS // 16, True, Split.valid, False),
    ],
)
def test_gpt_dataset_indices_match_the_reference(tmp_path, case, num_samples, extra, split, expect_separate):
    drop_last = split != Split.valid
    dataset = make_dataset(
        tmp_path,
        DOCUMENTS,
        num_samples,
        split=split,
        add_extra_token_to_sequence=extra,
        drop_last_partial_validation_sequence=drop_last,
    )
    sizes = [len(d) for d in DOCUMENTS]
    documents, rows, shuffle, separate = reference_gpt_indices(
        sizes, range(len(DOCUMENTS)), num_samples, 16, int(extra), 1234, drop_last
    )
    assert separate == expect_separate, case
    assert dataset.document_index.tolist() == documents
    assert [tuple(row) for row in dataset.sample_index.tolist()] == rows
    assert dataset.shuffle_index.tolist() == shuffle
    assert len(dataset) == len(rows) - 1
    assert num_samples is None or len(dataset) >= num_samples
    if not drop_last:
        usable_tokens = len(dataset.document_index) // len(DOCUMENTS) * TOKENS - 1
        assert len(dataset) == usable_tokens // 16 + 1, "the case must end in a partial sample"


@pytest.mark.parametrize("extra", [True, False])
def test_every_sample_is_its_window_of_the_shuffled_token_stream(tmp_path, extra):
    dataset = make_dataset(tmp_path, DOCUMENTS, 2 * TOKENS // 16, add_extra_token_to_sequence=extra)
    shuffled_documents = [DOCUMENTS[i] for i in dataset.document_index]
    for idx in range(len(dataset)):
        sample_id = int(dataset.shuffle_index[idx])
        begin = tuple(int(v) for v in dataset.sample_index[sample_id])
        expected = token_stream_sample(shuffled_documents, begin, 16, int(extra), PAD)
        sample = dataset[idx]
        if extra:
            assert sample["tokens"].tolist() == expected[:-1]
            assert sample["labels"].tolist() == expected[1:]
        else:
            assert sample["tokens"].tolist() == expected
            assert sample["labels"].tolist() == expected[1:] + [0]
            assert sample["loss_mask"][-1] == 0


def test_samples_overlap_by_the_label_token(tmp_path):
    dataset = make_dataset(tmp_path, DOCUMENTS, None)
    position_of_sample = np.argsort(dataset.shuffle_index)
    text = [dataset._query_document_sample_shuffle_indices(int(position_of_sample[s]))[0] for s in range(3)]
    assert text[0][-1] == text[1][0] and text[1][-1] == text[2][0]


def test_final_partial_validation_sample_is_padded_and_masked(tmp_path):
    documents = [[5, 6, 7, EOD]] * 5  # 20 tokens: one full sample of 16 + 1, then 3 tokens
    dataset = make_dataset(tmp_path, documents, None, split=Split.valid, drop_last_partial_validation_sequence=False)
    assert len(dataset) == 2
    last = dataset[int(np.where(dataset.shuffle_index == 1)[0][0])]
    # The second sample starts at token 16 of the stream [5, 6, 7, EOD] * 5: four real tokens, then padding.
    assert last["tokens"].tolist() == [5, 6, 7, EOD] + [0] * 12
    assert last["labels"].tolist() == [6, 7, EOD] + [0] * 13
    assert last["loss_mask"].tolist() == [1.0] * 3 + [0.0] * 13


def test_padding_id_falls_back_to_minus_one_without_a_tokenizer_pad(tmp_path):
    documents = [[5, 6, 7, EOD]] * 5
    dataset = make_dataset(
        tmp_path,
        documents,
        None,
        split=Split.valid,
        drop_last_partial_validation_sequence=False,
        tokenizer=TokenizerWithoutPad(),
    )
    assert dataset._pad_token_id == -1
    padded = dataset[int(np.where(dataset.shuffle_index == 1)[0][0])]
    assert padded["tokens"].min() >= 0 and padded["loss_mask"][-1] == 0


def reference_masks(tokens, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM's loop over EOD positions, written out."""
    length = len(tokens)
    mask = [[1.0 if k <= q else 0.0 for k in range(length)] for q in range(length)]
    loss = [0.0 if (eod_mask_loss and t == EOD) else 1.0 for t in tokens]
    positions = list(range(length))
    previous = 0
    for i in [p for p, t in enumerate(tokens) if t == EOD]:
        if reset_attention_mask:
            for q in range(i + 1, length):
                for k in range(i + 1):
                    mask[q][k] = 0.0
        if reset_position_ids:
            for q in range(i + 1, length):
                positions[q] -= i + 1 - previous
            previous = i + 1
    return [[value < 0.5 for value in row] for row in mask], loss, positions


@pytest.mark.parametrize("reset_position_ids", [False, True])
@pytest.mark.parametrize("reset_attention_mask", [False, True])
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_masks_and_position_ids_for_packed_documents(reset_position_ids, reset_attention_mask, eod_mask_loss):
    tokens = torch.tensor([EOD, 4, 5, EOD, 6, EOD, EOD, 7, 8, 9, EOD, 3])
    mask, loss, positions = _get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids, reset_attention_mask, eod_mask_loss, True
    )
    expected_mask, expected_loss, expected_positions = reference_masks(
        tokens.tolist(), reset_position_ids, reset_attention_mask, eod_mask_loss
    )
    assert mask.dtype == torch.bool and mask.shape == (1, 12, 12)
    assert mask[0].tolist() == expected_mask
    assert loss.tolist() == expected_loss
    assert positions.tolist() == expected_positions


def test_packed_documents_never_attend_across_an_eod():
    tokens = torch.tensor([4, 5, EOD, 6, 7, EOD, 8])
    mask, _, positions = _get_ltor_masks_and_position_ids(tokens, EOD, True, True, False, True)
    allowed = ~mask[0]
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert allowed[4].tolist() == [False, False, False, True, True, False, False]
    assert allowed[6].tolist() == [False] * 6 + [True]


def test_sample_masks_follow_the_config(tmp_path):
    dataset = make_dataset(tmp_path, DOCUMENTS, None, reset_position_ids=True, eod_mask_loss=True)
    sample = dataset[0]
    eod_positions = (sample["tokens"] == EOD).nonzero().flatten().tolist()
    assert eod_positions, "the sample should span a document boundary"
    assert all(sample["loss_mask"][p] == 0 for p in eod_positions)
    first = eod_positions[0]
    if first + 1 < 16:
        assert sample["position_ids"][first + 1] == 0


def test_cached_masks_are_not_shared_with_a_padded_sample(tmp_path):
    documents = [[5, 6, 7, EOD]] * 5
    dataset = make_dataset(tmp_path, documents, None, split=Split.valid, drop_last_partial_validation_sequence=False)
    padded_idx = int(np.where(dataset.shuffle_index == 1)[0][0])
    assert dataset[padded_idx]["loss_mask"].sum() < 16
    assert dataset[1 - padded_idx]["loss_mask"].sum() == 16
    assert dataset[0]["attention_mask"][0].tolist() == (~torch.ones(16, 16, dtype=torch.bool).tril()).tolist()


def test_padding_request_has_no_loss_and_attention_mask_is_optional(tmp_path):
    dataset = make_dataset(tmp_path, DOCUMENTS, None, create_attention_mask=False)
    sample = dataset[None]
    assert "attention_mask" not in sample
    assert sample["loss_mask"].sum() == 0
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}


def test_split_indices_select_the_documents(tmp_path):
    dataset = make_dataset(tmp_path, DOCUMENTS, None, indices=np.arange(20, 40, dtype=np.int32))
    assert set(dataset.document_index.tolist()) <= set(range(20, 40))


def test_indices_outside_the_low_level_dataset_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"indexed_indices for the train split .* must lie in \[0, 60\), got \[0, 60"):
        make_dataset(tmp_path, DOCUMENTS, None, indices=np.arange(61, dtype=np.int32))


def test_a_split_without_tokens_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"the train split of .*corpus holds 0 tokens in 2 sequences, too few"):
        make_dataset(tmp_path, [[], [], [1, 2]], 4, indices=np.arange(2, dtype=np.int32))


def test_negative_num_samples_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"num_samples must be None \(one epoch\) or an integer >= 0, got -3"):
        make_dataset(tmp_path, DOCUMENTS, -3)


def test_index_split_must_be_a_split(tmp_path):
    with pytest.raises(ValueError, match=r"index_split must be a Split \(train, valid or test\), got 'train'"):
        make_dataset(tmp_path, DOCUMENTS, None, split="train")


def test_sample_index_needs_enough_tokens_for_one_extra_token():
    with pytest.raises(ValueError, match=r"0 tokens cannot hold a sample of 4 \+ 1 tokens"):
        index_helpers.build_sample_index(np.zeros(2, np.int32), np.arange(2, dtype=np.int32), 4, 1, 0)


# ---- the index cache -------------------------------------------------------------------------------------------


def test_second_build_reads_the_cache_instead_of_rebuilding(tmp_path, monkeypatch):
    first = make_dataset(tmp_path, DOCUMENTS, 100)
    assert first.built_anew_on_cache_miss

    def must_not_run(*args, **kwargs):
        raise AssertionError("the sample index was rebuilt despite a complete cache")

    monkeypatch.setattr(gpt_dataset, "build_sample_index", must_not_run)
    second = make_dataset(tmp_path, DOCUMENTS, 100)
    assert not second.built_anew_on_cache_miss
    assert isinstance(second.sample_index, np.memmap)
    assert np.array_equal(second.sample_index, first.sample_index)
    assert np.array_equal(second.shuffle_index, first.shuffle_index)
    assert second[5]["tokens"].tolist() == first[5]["tokens"].tolist()


def test_cache_files_are_named_by_the_md5_of_the_description(tmp_path):
    dataset = make_dataset(tmp_path, DOCUMENTS, 100)
    names = sorted(os.listdir(tmp_path / "cache"))
    digest = dataset.unique_description_hash
    assert names == sorted(
        f"{digest}-GPTDataset-train-{suffix}"
        for suffix in ["description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"]
    )
    description = (tmp_path / "cache" / f"{digest}-GPTDataset-train-description.txt").read_text()
    assert hashlib.md5(description.encode()).hexdigest() == digest
    assert '"class": "GPTDataset"' in description and '"tokenizer": {' in description


def test_a_different_seed_or_length_gets_its_own_cache(tmp_path):
    a = make_dataset(tmp_path, DOCUMENTS, 100)
    b = make_dataset(tmp_path, DOCUMENTS, 100, random_seed=5)
    c = make_dataset(tmp_path, DOCUMENTS, 100, sequence_length=8)
    assert len({a.unique_description_hash, b.unique_description_hash, c.unique_description_hash}) == 3
    assert b.built_anew_on_cache_miss and c.built_anew_on_cache_miss


def test_default_cache_directory_is_under_the_prefix_as_megatron(tmp_path):
    make_dataset(tmp_path, DOCUMENTS, 10, path_to_cache=None)
    assert len(os.listdir(tmp_path / "corpus" / "cache" / "GPTDataset_indices")) == 4


def test_a_crash_while_writing_leaves_no_trusted_partial_cache(tmp_path, monkeypatch):
    real_save = np.save

    def save_then_crash(file, array, **kwargs):
        if array.ndim == 1 and array.dtype == np.uint32:  # the shuffle index, written after the others
            file.write(b"partial")
            raise OSError("disk full")
        real_save(file, array, **kwargs)

    monkeypatch.setattr(index_cache.np, "save", save_then_crash)
    with pytest.raises(OSError, match=r"cannot write the dataset index cache in .*cache \(disk full\); point"):
        make_dataset(tmp_path, DOCUMENTS, 100)
    monkeypatch.undo()
    leftovers = os.listdir(tmp_path / "cache")
    assert not any("tmp" in name or "shuffle_index" in name for name in leftovers)

    rebuilt = make_dataset(tmp_path, DOCUMENTS, 100)
    assert rebuilt.built_anew_on_cache_miss
    assert not make_dataset(tmp_path, DOCUMENTS, 100).built_anew_on_cache_miss


def test_unwritable_cache_directory_names_the_fix(tmp_path):
    (tmp_path / "not_a_dir").write_text("")
    with pytest.raises(OSError, match=r"cannot write the dataset index cache in .*not_a_dir/cache .*--data-cache-path"):
        make_dataset(tmp_path, DOCUMENTS, 10, path_to_cache=str(tmp_path / "not_a_dir" / "cache"))


def test_a_corrupt_cache_file_is_reported(tmp_path):
    dataset = make_dataset(tmp_path, DOCUMENTS, 100)
    path = tmp_path / "cache" / f"{dataset.unique_description_hash}-GPTDataset-train-sample_index.npy"
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(IndexCacheError, match=r"index cache file .*sample_index.npy is unreadable .*delete it"):
        make_dataset(tmp_path, DOCUMENTS, 100)


def test_cache_files_that_do_not_fit_together_are_reported(tmp_path):
    dataset = make_dataset(tmp_path, DOCUMENTS, 100)
    path = tmp_path / "cache" / f"{dataset.unique_description_hash}-GPTDataset-train-shuffle_index.npy"
    np.save(path, np.arange(3, dtype=np.uint32))
    with pytest.raises(IndexCacheError, match=r"shuffle_index.npy has shape \(3,\) but .* describes \d+ samples"):
        make_dataset(tmp_path, DOCUMENTS, 100)
    np.save(path.with_name(path.name.replace("shuffle", "sample")), np.zeros(4, dtype=np.int32))
    with pytest.raises(IndexCacheError, match=r"sample_index.npy has shape \(4,\), expected \[num_samples \+ 1, 2\]"):
        make_dataset(tmp_path, DOCUMENTS, 100)


# ---- MockGPTDataset ----------------------------------------------------------------------------------------------


class SmallVocabTokenizer(ToyTokenizer):
    vocab_size = 100
    eod = 99


def test_mock_low_level_dataset_is_megatrons_synthetic_corpus():
    low_level = MockGPTLowLevelDataset(ToyTokenizer())
    expected = np.random.default_rng(seed=0).integers(low=1, high=4096, size=100000, dtype=np.int32)
    assert np.array_equal(low_level.sequence_lengths, expected)
    document = low_level[3]
    assert document.tolist() == list(range(1, int(expected[3]))) + [EOD]
    assert low_level.get(3, offset=2, length=4).tolist() == [3, 4, 5, 6]


def test_mock_ids_wrap_into_a_small_vocabulary():
    low_level = MockGPTLowLevelDataset(SmallVocabTokenizer())
    long_document = int(np.argmax(low_level.sequence_lengths))
    tokens = low_level[long_document]
    assert tokens[:-1].min() == 1 and tokens[:-1].max() == 98 and tokens[-1] == 99


def test_mock_gpt_dataset_is_deterministic_and_needs_mock_config(tmp_path):
    config = GPTDatasetConfig(random_seed=3, sequence_length=32, tokenizer=ToyTokenizer())
    low_level = MockGPTDataset.build_low_level_dataset(None, config)
    indices = np.arange(50, dtype=np.int32)
    a = MockGPTDataset(low_level, None, indices, 20, Split.train, config)
    b = MockGPTDataset(low_level, None, indices, 20, Split.train, config)
    assert len(a) >= 20 and a[7]["tokens"].tolist() == b[7]["tokens"].tolist()
    assert a._cache_directory() is None and b.built_anew_on_cache_miss
    with pytest.raises(ValueError, match=r"MockGPTDataset needs config.mock=True"):
        MockGPTDataset(low_level, None, indices, 20, Split.train, make_config(tmp_path))
