"""Dataset configs and helpers: split parsing and book-ends, blend parsing, weight normalisation, every error."""

import pytest

from megatron.core.datasets.blended_megatron_dataset_config import (
    BlendedMegatronDatasetConfig,
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.utils import Split, get_blend_from_list, normalize
from tests.unit_tests.datasets.corpus import ToyTokenizer


def test_split_enum_order():
    assert [s.name for s in Split] == ["train", "valid", "test"] and [s.value for s in Split] == [0, 1, 2]


@pytest.mark.parametrize(
    "split, expected",
    [
        ("949,50,1", [0.949, 0.05, 0.001]),
        ("98,2", [0.98, 0.02, 0.0]),
        ("1", [1.0, 0.0, 0.0]),
        ("90/5/5", [0.9, 0.05, 0.05]),
        ("0.5, 0.25, 0.25", [0.5, 0.25, 0.25]),
    ],
)
def test_parse_and_normalize_split(split, expected):
    assert parse_and_normalize_split(split) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize(
    "split, message",
    [
        ("abc", r"split 'abc' holds no numbers; expected e.g. '949,50,1'"),
        ("1,2,3,4", r"split '1,2,3,4' has 4 values but there are only 3 splits"),
        ("0,0,0", r"split '0,0,0' gives every split 0; give the train split a positive share"),
        ("1.2.3,4", r"split '1.2.3,4' holds a malformed number"),
        (949, r"split must be a string such as '949,50,1', got 949"),
    ],
)
def test_bad_split_strings(split, message):
    with pytest.raises(ValueError, match=message):
        parse_and_normalize_split(split)


def test_split_matrix_bookends_are_running_float_sums():
    vector = parse_and_normalize_split("949,50,1")
    matrix = convert_split_vector_to_split_matrix(vector)
    assert matrix == [(0, vector[0]), (vector[0], vector[0] + vector[1]), (vector[0] + vector[1], 1.0)]
    assert convert_split_vector_to_split_matrix([0.9, 0.0, 0.1]) == [(0, 0.9), None, (0.9, 1.0)]


def test_split_matrix_of_two_vectors_is_their_overlap():
    assert convert_split_vector_to_split_matrix([0.5, 0.25, 0.25], [0.25, 0.25, 0.5]) == [
        (0, 0.25),
        (0.5, 0.5),
        (0.75, 1.0),
    ]


@pytest.mark.parametrize(
    "blend, expected",
    [
        (None, None),
        (["0.3", "a", "0.7", "b"], (["a", "b"], [0.3, 0.7])),
        (["a", "b"], (["a", "b"], None)),
        (["a"], (["a"], None)),
        (["1", " data/x "], (["data/x"], [1.0])),
        (["a", "b", "c"], (["a", "b", "c"], None)),
    ],
)
def test_get_blend_from_list(blend, expected):
    assert get_blend_from_list(blend) == expected


@pytest.mark.parametrize(
    "blend, message",
    [
        ([], r"blend \(--data-path\) is empty: give at least one dataset prefix"),
        (["0.3", "a", "b", "c"], r"cannot tell weights from prefixes in blend \['0.3', 'a', 'b', 'c'\]: give a weight"),
    ],
)
def test_bad_blend_lists(blend, message):
    with pytest.raises(ValueError, match=message):
        get_blend_from_list(blend)


def test_normalize():
    assert normalize([3, 1]) == [0.75, 0.25]
    assert normalize([0.3, 0.7]) == [0.3 / 1.0, 0.7 / 1.0]


@pytest.mark.parametrize(
    "weights, message",
    [
        ([], r"weights must be a non-empty list of numbers, got \[\]"),
        ([1, -1], r"weights must be finite and >= 0, got \[1, -1\]"),
        ([1, float("nan")], r"weights must be finite and >= 0"),
        ([0, 0], r"weights must not all be 0, got \[0, 0\]: give at least one dataset a positive weight"),
    ],
)
def test_normalize_errors(weights, message):
    with pytest.raises(ValueError, match=message):
        normalize(weights)


def test_no_blend_means_mock_data_with_an_even_split():
    config = BlendedMegatronDatasetConfig(random_seed=1, sequence_length=8)
    assert config.mock and config.split == "1,1,1"
    assert config.split_matrix == [(0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.0)]
    assert BlendedMegatronDatasetConfig(random_seed=1, sequence_length=8, split="1").split_matrix[1:] == [None, None]


def test_blend_config_derives_the_split_matrix():
    config = BlendedMegatronDatasetConfig(random_seed=1, sequence_length=8, blend=(["a"], None), split="98,2")
    assert not config.mock
    assert config.split_matrix == [(0, 0.98), (0.98, 1.0), None]


def test_blend_per_split_config():
    config = BlendedMegatronDatasetConfig(
        random_seed=1, sequence_length=8, blend_per_split=[(["a", "b"], [1, 2]), None, (["c"], None)]
    )
    assert not config.mock and config.split_matrix is None


def test_all_none_blend_per_split_means_mock():
    assert BlendedMegatronDatasetConfig(random_seed=1, sequence_length=8, blend_per_split=[None] * 3).mock


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(random_seed=-1), r"random_seed must be an integer in \[0, 2\*\*32\) .*got -1"),
        (dict(random_seed=2**32), r"random_seed must be an integer in \[0, 2\*\*32\)"),
        (dict(sequence_length=0), r"sequence_length must be a positive integer, got 0"),
        (dict(num_dataset_builder_threads=0), r"num_dataset_builder_threads must be an integer >= 1, got 0"),
        (dict(mid_level_dataset_surplus=-0.1), r"mid_level_dataset_surplus must be a number >= 0 .*got -0.1"),
        (dict(blend=(["a"], None)), r"split is required with blend: give e.g. split='949,50,1' \(--split\)"),
        (
            dict(blend=(["a"], None), blend_per_split=[(["a"], None), None, None]),
            r"blend and blend_per_split are mutually exclusive: set only one of them",
        ),
        (
            dict(split="1", blend_per_split=[(["a"], None), None, None]),
            r"split \('1'\) does not apply with blend_per_split .*set split=None",
        ),
        (
            dict(blend_per_split=[(["a"], None), None]),
            r"blend_per_split must hold 3 entries \(train, valid, test; None for an unused split\), got 2",
        ),
        (
            dict(blend_per_split=[None, (["a", "b"], [1.0]), None]),
            r"blend_per_split\[1\] \(valid\): 1 weights for 2 prefixes; give one weight per prefix or None",
        ),
        (dict(blend=(["a", "b"], [1.0]), split="1"), r"blend: 1 weights for 2 prefixes"),
        (dict(blend=(["a"], [-1.0]), split="1"), r"blend: weights must be finite and >= 0, got \[-1.0\]"),
        (dict(blend=("a", None), split="1"), r"blend: prefixes must be a non-empty list of path prefixes, got 'a'"),
        (dict(blend=(["a", ""], None), split="1"), r"blend: every prefix must be a non-empty string"),
        (dict(blend=["a"], split="1"), r"blend must be a pair \(prefixes, weights or None\), got \['a'\]; build it"),
        (dict(blend=(["a"], None), split="x"), r"split 'x' holds no numbers"),
        (dict(blend=(["a"], None), split="1", mock=True), r"mock=True cannot be combined with blend"),
        (
            dict(blend_per_split=[(["a"], None), None, None], mock=True),
            r"mock=True cannot be combined with blend_per_split",
        ),
    ],
)
def test_config_errors(overrides, message):
    settings = dict(random_seed=1, sequence_length=8)
    settings.update(overrides)
    with pytest.raises(ValueError, match=message):
        BlendedMegatronDatasetConfig(**settings)


class NoEod:
    pad = 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(tokenizer=None), r"GPTDatasetConfig needs a tokenizer \(any object with `eod` and `pad`\)"),
        (dict(tokenizer=NoEod()), r"the tokenizer \(NoEod\) has no `eod` attribute"),
        (dict(reset_position_ids=1), r"reset_position_ids must be True or False, got 1"),
        (dict(create_attention_mask=None), r"create_attention_mask must be True or False, got None"),
    ],
)
def test_gpt_config_errors(overrides, message):
    settings = dict(random_seed=1, sequence_length=8, tokenizer=ToyTokenizer())
    settings.update(overrides)
    with pytest.raises(ValueError, match=message):
        GPTDatasetConfig(**settings)


def test_gpt_config_defaults():
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=ToyTokenizer())
    assert (config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss) == (False, False, False)
    assert config.create_attention_mask and config.add_extra_token_to_sequence
    assert config.drop_last_partial_validation_sequence and config.mid_level_dataset_surplus == 0.005
    assert config.mmap_bin_files and config.num_dataset_builder_threads == 1 and config.path_to_cache is None
