"""BlendedMegatronDatasetBuilder: split book-ends, blends and their surplus sizes, per-split blends, mock data,
rank-0-first building with the index cache on 2 gloo ranks, and the argument errors."""

import math

import numpy as np
import pytest

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import Split
from tests.unit_tests.datasets.corpus import ToyTokenizer, random_documents, write_corpus
from tests.unit_tests.test_utilities import run_distributed


def gpt_config(tmp_path, **overrides):
    settings = dict(random_seed=11, sequence_length=8, path_to_cache=str(tmp_path / "cache"), tokenizer=ToyTokenizer())
    settings.update(overrides)
    return GPTDatasetConfig(**settings)


def build(config, sizes, cls=GPTDataset, is_built_on_rank=lambda: True):
    return BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()


@pytest.fixture
def corpora(tmp_path):
    """Three prefixes: 1000, 300 and 200 short documents."""
    return {
        name: write_corpus(str(tmp_path / name), random_documents(seed, count, max_length=12, allow_empty=False))
        for seed, (name, count) in enumerate([("big", 1000), ("a", 300), ("b", 200)])
    }


def test_split_bookends_cut_the_sequences(tmp_path, corpora):
    config = gpt_config(tmp_path, blend=([corpora["big"]], None), split="949,50,1")
    assert config.split_matrix == [(0, 0.949), (0.949, 0.999), (0.999, 1.0)]
    train, valid, test = build(config, [100, 10, 1])
    assert train.indices.tolist() == list(range(0, 949))
    assert valid.indices.tolist() == list(range(949, 999))
    assert test.indices.tolist() == [999]
    assert train.indices.dtype == np.int32
    assert [d.index_split for d in (train, valid, test)] == [Split.train, Split.valid, Split.test]
    assert train.num_samples == 100 and len(train) >= 100


def test_empty_and_zero_width_splits_give_none(tmp_path, corpora):
    config = gpt_config(tmp_path, blend=([corpora["b"]], None), split="949,50,1")
    train, valid, test = build(config, [10, 10, 10])
    assert test is None  # round(0.999 * 200) == round(1.0 * 200): no sequences
    assert valid.indices.tolist() == list(range(190, 200))
    config = gpt_config(tmp_path, blend=([corpora["b"]], None), split="1,0,0")
    assert build(config, [10, 10, 10])[1:] == [None, None]


def test_weighted_blend_builds_each_prefix_with_its_share_plus_surplus(tmp_path, corpora):
    config = gpt_config(tmp_path, blend=([corpora["a"], corpora["b"]], [3, 1]), split="90,10,0")
    train, valid, test = build(config, [1000, 40, 0])
    assert test is None
    assert isinstance(train, BlendedDataset) and len(train) == 1000 and len(valid) == 40
    assert train.weights == [0.75, 0.25]
    for target, blended in [(1000, train), (40, valid)]:
        expected = [math.ceil(math.ceil(target * w) * 1.005) for w in (0.75, 0.25)]
        assert [d.num_samples for d in blended.datasets] == expected
    assert np.bincount(train.dataset_index).tolist() == [750, 250]
    assert train[3]["tokens"].shape == (8,)


def test_unweighted_blend_uses_each_dataset_once(tmp_path, corpora):
    config = gpt_config(tmp_path, blend=([corpora["a"], corpora["b"]], None), split="1")
    train, _, _ = build(config, [None, None, None])
    assert [d.num_samples for d in train.datasets] == [None, None]
    assert len(train) == sum(len(d) for d in train.datasets)
    limited, _, _ = build(config, [25, None, None])
    assert len(limited) == 25


def test_per_split_blends(tmp_path, corpora):
    config = gpt_config(
        tmp_path,
        blend_per_split=[([corpora["a"], corpora["b"]], [0.5, 0.5]), ([corpora["big"]], None), None],
    )
    train, valid, test = build(config, [100, 20, 5])
    assert test is None
    assert isinstance(train, BlendedDataset) and len(train) == 100
    assert isinstance(valid, GPTDataset) and valid.indices.tolist() == list(range(1000))
    assert valid.index_split == Split.valid and train.split == Split.train


def test_mock_data_builds_three_mock_splits(tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=32, tokenizer=ToyTokenizer())
    assert config.mock and config.split == "1,1,1"
    train, valid, test = build(config, [10, 5, 5], cls=MockGPTDataset)
    assert all(isinstance(d, MockGPTDataset) for d in (train, valid, test))
    assert len(train.indices) == 33333 and train.indices[0] == 0 and valid.indices[0] == 33333
    assert train[0]["tokens"].shape == (32,)


def test_gpt_dataset_from_a_config_without_a_blend_names_the_fix(tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=32, tokenizer=ToyTokenizer())
    with pytest.raises(ValueError, match=r"no blend or blend_per_split.*give blend=.*or build MockGPTDataset"):
        build(config, [10, 5, 5], cls=GPTDataset)


def test_ranks_that_do_not_build_get_none(tmp_path, corpora):
    config = gpt_config(tmp_path, blend=([corpora["a"]], None), split="1,1,1")
    assert build(config, [5, 5, 5], is_built_on_rank=lambda: False) == [None, None, None]


def test_builder_threads_give_the_same_datasets(tmp_path, corpora):
    prefixes = [corpora["a"], corpora["b"], corpora["big"]]
    serial = build(gpt_config(tmp_path, blend=(prefixes, [1, 1, 1]), split="1"), [300, None, None])[0]
    threaded = build(
        gpt_config(tmp_path / "t", blend=(prefixes, [1, 1, 1]), split="1", num_dataset_builder_threads=3),
        [300, None, None],
    )[0]
    assert threaded.dataset_index.tolist() == serial.dataset_index.tolist()
    assert threaded[42]["tokens"].tolist() == serial[42]["tokens"].tolist()


@pytest.mark.parametrize(
    "sizes, message",
    [
        ([10, 10], r"sizes must hold 3 entries \(train, valid, test samples\), got \[10, 10\]"),
        ([10, -1, 0], r"sizes\[1\] \(valid\) must be None or an integer >= 0, got -1"),
        ([10, 2.5, 0], r"sizes\[1\] \(valid\) must be None or an integer >= 0, got 2.5"),
        ([None, 1, 1], r"sizes\[0\] \(train\) is None but its blend has weights: give the number of train"),
    ],
)
def test_builder_argument_errors(tmp_path, corpora, sizes, message):
    config = gpt_config(tmp_path, blend=([corpora["a"], corpora["b"]], [1, 1]), split="1,1,1")
    with pytest.raises(ValueError, match=message):
        BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)


def test_a_prefix_without_sequences_in_a_blended_split_is_reported(tmp_path, corpora):
    tiny = write_corpus(str(tmp_path / "tiny"), [[5, 6, 0], [7, 0]])
    config = gpt_config(tmp_path, blend=([corpora["a"], tiny], None), split="98,1,1")
    with pytest.raises(ValueError, match=r"tiny has no sequences in the valid split \(split '98,1,1'\), so it cannot"):
        build(config, [None, None, None])


# ---- several ranks: rank 0 builds and caches first, the others read the cache -----------------------------------


def _build_on_rank(prefix_a, prefix_b, cache, built_on_rank_1):
    import torch.distributed as dist

    config = GPTDatasetConfig(
        random_seed=11,
        sequence_length=8,
        blend=([prefix_a, prefix_b], [0.6, 0.4]),
        split="80,20,0",
        path_to_cache=cache,
        tokenizer=ToyTokenizer(),
    )
    is_built = (lambda: True) if built_on_rank_1 else (lambda: dist.get_rank() == 0)
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [200, 20, 0], is_built, config).build()
    if train is None:
        return None
    return (
        train.built_anew_on_cache_miss,
        [d.built_anew_on_cache_miss for d in train.datasets],
        train.dataset_index.tolist(),
        train[17]["tokens"].tolist(),
        test,
    )


def test_rank_0_builds_the_cache_and_the_other_rank_reads_it(tmp_path, corpora):
    rank_0, rank_1 = run_distributed(2, _build_on_rank, corpora["a"], corpora["b"], str(tmp_path / "c"), True)
    assert rank_0[:2] == (True, [True, True])
    assert rank_1[:2] == (False, [False, False])
    assert rank_0[2:] == rank_1[2:]


def test_a_rank_that_does_not_build_still_joins_the_collectives(tmp_path, corpora):
    rank_0, rank_1 = run_distributed(2, _build_on_rank, corpora["a"], corpora["b"], str(tmp_path / "c"), False)
    assert rank_0 is not None and rank_1 is None


def _build_with_missing_prefix(cache):
    import torch.distributed as dist

    config = GPTDatasetConfig(
        random_seed=1, sequence_length=8, blend=([cache + "/missing"], None), split="1", tokenizer=ToyTokenizer()
    )
    try:
        BlendedMegatronDatasetBuilder(GPTDataset, [10, None, None], lambda: True, config).build()
    except Exception as error:  # each rank reports what it raised
        return dist.get_rank(), type(error).__name__, str(error)
    return dist.get_rank(), None, None


def test_a_failure_on_rank_0_stops_every_rank_without_a_hang(tmp_path):
    rank_0, rank_1 = run_distributed(2, _build_with_missing_prefix, str(tmp_path), timeout=60)
    assert rank_0[1] is not None and "missing" in rank_0[2]
    message = "global rank 0 failed to build the datasets (see that rank's error); stopping"
    assert rank_1[1:] == ("RuntimeError", message)


def _rank_1_cannot_open_a_prefix(prefix_a, prefix_b, cache):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        prefix_b += "-missing-on-this-rank"
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=8,
        blend=([prefix_a, prefix_b], [1, 1]),
        split="1",
        path_to_cache=cache,
        tokenizer=ToyTokenizer(),
    )
    try:
        BlendedMegatronDatasetBuilder(GPTDataset, [10, None, None], lambda: True, config).build()
    except Exception as error:  # each rank reports what it raised
        return type(error).__name__, str(error)
    return None


def test_a_failure_on_another_rank_stops_rank_0_before_the_next_collective(tmp_path, corpora):
    rank_0, rank_1 = run_distributed(
        2, _rank_1_cannot_open_a_prefix, corpora["a"], corpora["b"], str(tmp_path / "c"), timeout=60
    )
    assert rank_0 == ("RuntimeError", "the other ranks failed to build the datasets (see that rank's error); stopping")
    assert "missing-on-this-rank" in rank_1[1]


def _rank_0_must_build():
    import torch.distributed as dist

    config = GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=ToyTokenizer())
    try:
        BlendedMegatronDatasetBuilder(MockGPTDataset, [1, 1, 1], lambda: dist.get_rank() != 0, config)
    except ValueError as error:
        return str(error)
    return None


def test_is_built_on_rank_must_hold_on_rank_0():
    rank_0, rank_1 = run_distributed(2, _rank_0_must_build)
    assert rank_0 == "is_built_on_rank must return True on global rank 0, which builds the index caches"
    assert rank_1 is None
