"""BlendedDataset: Megatron-LM's greedy blend vs a loop reference, the exhaustive variant, proportions, caching."""

from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets import blended_dataset as blended_module
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.index_helpers import build_blending_indices, build_exhaustive_blending_indices
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split, normalize
from tests.unit_tests.datasets.corpus import ToyTokenizer, random_documents, write_corpus
from tests.unit_tests.datasets.reference_indices import reference_blending, reference_exhaustive_blending


@pytest.mark.parametrize("trial", range(25))
def test_greedy_blend_matches_the_reference_loop(trial):
    rng = np.random.default_rng(trial)
    weights = normalize(rng.random(int(rng.integers(1, 6))).tolist())
    size = int(rng.integers(0, 2000))
    dataset_index, sample_index = build_blending_indices(weights, size)
    expected_datasets, expected_samples = reference_blending(weights, size)
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
    assert dataset_index.tolist() == expected_datasets
    assert sample_index.tolist() == expected_samples


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.25] * 4, [0.3, 0.7], [0.1, 0.2, 0.7], [1 / 3] * 3])
def test_greedy_blend_breaks_ties_like_the_reference(weights):
    assert build_blending_indices(weights, 500)[0].tolist() == reference_blending(weights, 500)[0]


def test_greedy_blend_opens_with_the_heaviest_dataset_and_tracks_the_weights():
    dataset_index, sample_index = build_blending_indices([0.3, 0.7], 1000)
    assert dataset_index[:4].tolist() == [1, 0, 1, 1]
    counts = np.bincount(dataset_index, minlength=2)
    assert counts.tolist() == [300, 700]
    for k in range(1, 1000):
        drawn = np.bincount(dataset_index[:k], minlength=2)
        assert np.all(np.abs(drawn - np.array([0.3, 0.7]) * k) <= 1.0)
    assert sample_index[dataset_index == 0].tolist() == list(range(300))


@pytest.mark.parametrize("sizes", [[5, 9, 2], [1], [0, 4, 4], [30, 1], [7, 7, 7, 7]])
def test_exhaustive_blend_uses_every_sample_once(sizes):
    dataset_index, sample_index = build_exhaustive_blending_indices(sizes)
    assert (dataset_index.tolist(), sample_index.tolist()) == reference_exhaustive_blending(sizes)
    for dataset_id, size in enumerate(sizes):
        assert sorted(sample_index[dataset_index == dataset_id].tolist()) == list(range(size))


def test_exhaustive_blend_matches_the_reference_loop():
    rng = np.random.default_rng(0)
    for _ in range(20):
        sizes = rng.integers(1, 60, int(rng.integers(1, 5))).tolist()
        assert [a.tolist() for a in build_exhaustive_blending_indices(sizes)] == list(
            reference_exhaustive_blending(sizes)
        )


# ---- BlendedDataset over real GPTDatasets ------------------------------------------------------------------------


@pytest.fixture
def two_datasets(tmp_path):
    config = GPTDatasetConfig(
        random_seed=5,
        sequence_length=8,
        blend=([str(tmp_path / "a"), str(tmp_path / "b")], None),
        split="1",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=ToyTokenizer(),
    )
    datasets = []
    for seed, name in [(1, "a"), (2, "b")]:
        prefix = write_corpus(str(tmp_path / name), random_documents(seed, 30))
        low_level = IndexedDataset(prefix)
        indices = np.arange(len(low_level), dtype=np.int32)
        datasets.append(GPTDataset(low_level, prefix, indices, 40, Split.train, config))
    return datasets, config


def test_blended_samples_come_from_the_chosen_dataset(two_datasets):
    datasets, config = two_datasets
    blend = BlendedDataset(datasets, [0.25, 0.75], 60, config)
    assert len(blend) == 60
    for idx in [0, 1, 2, 17, 59]:
        dataset_id = int(blend.dataset_index[idx])
        sample = blend[idx]
        assert sample["dataset_id"] == dataset_id
        expected = datasets[dataset_id][int(blend.dataset_sample_index[idx])]
        assert sample["tokens"].tolist() == expected["tokens"].tolist()
    assert np.bincount(blend.dataset_index).tolist() == [15, 45]


def test_unweighted_blend_is_exhaustive(two_datasets):
    datasets, config = two_datasets
    blend = BlendedDataset(datasets, None, None, config)
    assert len(blend) == len(datasets[0]) + len(datasets[1])
    truncated = BlendedDataset(datasets, None, 10, config)
    assert truncated.dataset_index.tolist() == blend.dataset_index[:10].tolist()


def test_blend_indices_are_cached(two_datasets, monkeypatch):
    datasets, config = two_datasets
    first = BlendedDataset(datasets, [0.5, 0.5], 50, config)
    assert first.built_anew_on_cache_miss

    def must_not_run(*args, **kwargs):
        raise AssertionError("the blending indices were rebuilt despite a complete cache")

    monkeypatch.setattr(blended_module, "build_blending_indices", must_not_run)
    second = BlendedDataset(datasets, [0.5, 0.5], 50, config)
    assert not second.built_anew_on_cache_miss
    assert second.dataset_index.tolist() == first.dataset_index.tolist()
    cache_files = sorted(p.name for p in Path(config.path_to_cache).iterdir() if "BlendedDataset" in p.name)
    assert cache_files == [
        f"{first.unique_description_hash}-BlendedDataset-train-{suffix}"
        for suffix in ["dataset_index.npy", "dataset_sample_index.npy", "description.txt"]
    ]


def test_cached_blend_of_the_wrong_size_is_reported(two_datasets):
    datasets, config = two_datasets
    blend = BlendedDataset(datasets, [0.5, 0.5], 50, config)
    path = Path(config.path_to_cache) / f"{blend.unique_description_hash}-BlendedDataset-train-dataset_index.npy"
    np.save(path, np.zeros(3, dtype=np.int16))
    with pytest.raises(ValueError, match=r"dataset_index.npy has shape \(3,\), expected \(50,\); delete"):
        BlendedDataset(datasets, [0.5, 0.5], 50, config)


def test_a_blend_that_overdraws_a_dataset_names_the_surplus_flag(two_datasets):
    datasets, config = two_datasets
    too_many = len(datasets[1]) * 2
    with pytest.raises(
        ValueError,
        match=r"draws \d+ samples from dataset 1 \(.*b\), which has only \d+: raise "
        r"mid_level_dataset_surplus \(--mid-level-dataset-surplus, now 0.005\)",
    ):
        BlendedDataset(datasets, [0.1, 0.9], too_many, config)


@pytest.mark.parametrize(
    "weights, size, message",
    [
        ([0.5], 10, r"1 weights for 2 datasets; give one weight per dataset"),
        ([0.5, 0.6], 10, r"weights must be normalised to sum to 1, got sum 1.1; use .*normalize"),
        ([-0.5, 1.5], 10, r"weights must be finite numbers >= 0, got \[-0.5, 1.5\]"),
        ([0.5, 0.5], None, r"size is required when weights are given"),
        ([0.5, 0.5], -1, r"size must be None or an integer >= 0, got -1"),
        (None, 10**6, r"size 1000000 exceeds the \d+ samples of the 2 datasets blended without weights"),
    ],
)
def test_blended_dataset_argument_errors(two_datasets, weights, size, message):
    datasets, config = two_datasets
    with pytest.raises(ValueError, match=message):
        BlendedDataset(datasets, weights, size, config)


def test_blended_dataset_needs_datasets_of_one_split(two_datasets):
    datasets, config = two_datasets
    with pytest.raises(ValueError, match=r"needs at least one dataset"):
        BlendedDataset([], None, None, config)
    with pytest.raises(ValueError, match=r"BlendedDataset takes at most 32768 datasets \(int16 ids\), got 32769"):
        BlendedDataset(datasets[:1] * 32769, None, None, config)
    other = GPTDataset(datasets[1].dataset, datasets[1].dataset_path, datasets[1].indices, 5, Split.valid, config)
    with pytest.raises(ValueError, match=r"all blended datasets must belong to one split, got \['train', 'valid'\]"):
        BlendedDataset([datasets[0], other], [0.5, 0.5], 5, config)
