"""The hybrid layer pattern parser: valid patterns, counts, pipeline segments, the deprecated ratios, every error."""

import pytest

from megatron.core.models.hybrid.hybrid_layer_allocation import (
    ParsedHybridPattern,
    Symbols,
    get_hybrid_layer_counts,
    get_hybrid_total_layer_count,
    get_hybrid_total_pipeline_segment_count,
    get_layer_maps_from_layer_type_list,
    parse_hybrid_pattern,
    pattern_from_ratios,
    refuse_layer_types_not_built,
    select_pipeline_segment,
    validate_segment_layers,
)
from megatron.core.models.hybrid.hybrid_model import resolve_hybrid_layer_pattern

# The 8B hybrid of arXiv 2406.07887 (Megatron's examples/mamba): 56 layers, 24 Mamba, 4 attention, 28 MLP.
PATTERN_8B = "M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-"


class FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_the_8b_pattern_counts():
    assert get_hybrid_total_layer_count(PATTERN_8B) == 56
    counts = get_hybrid_layer_counts(PATTERN_8B)
    assert (counts["M"], counts["*"], counts["-"], counts["E"]) == (24, 4, 28, 0)


def test_symbols_sort_by_name():
    assert Symbols.name_sorted_valid_layer_symbols() == ["*", "D", "G", "M", "+", "-", "E"]
    assert list(get_hybrid_layer_counts("M*")) == ["*", "D", "G", "M", "+", "-", "E"]


def test_pipes_and_mtp_parts():
    assert parse_hybrid_pattern("M-M-|M-M*-/MM/MM") == ParsedHybridPattern("M-M-|M-M*-", "MM", 2)
    assert parse_hybrid_pattern("M*M*") == ParsedHybridPattern("M*M*", None, 0)
    assert parse_hybrid_pattern(None) == ParsedHybridPattern(None, None, 0)
    assert parse_hybrid_pattern("M*/") == ParsedHybridPattern("M*", None, 0)
    assert get_hybrid_total_layer_count("M-M-|M-M*-/MM/MM") == 9
    assert get_hybrid_total_pipeline_segment_count("M-M-|M-M*-|M|M/MM") == 4
    counts = get_hybrid_layer_counts("M-M-|M-M*-/MM/MM")
    assert (counts["M"], counts["-"], counts["*"]) == (8, 4, 1)
    assert validate_segment_layers("M*-") == ["M", "*", "-"]


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("M*X-", r"'X' at position 2 is not a layer symbol"),
        ("M* -", r"' ' at position 2 is not a layer symbol"),
        ("M*/M|M", r"MTP pattern 'M\|M': '\|' at position 1 is not a layer symbol \(pipeline separators"),
        ("M*/MM/M*", r"every MTP depth must have the same pattern, but depth 1 is 'MM' and depth 2 is 'M\*'"),
    ],
)
def test_bad_patterns_are_refused(pattern, message):
    with pytest.raises(ValueError, match=message):
        parse_hybrid_pattern(pattern)


def test_segments_have_no_pipes():
    with pytest.raises(ValueError, match=r"pipeline segment 'M\|M': '\|' at position 1"):
        validate_segment_layers("M|M")


@pytest.mark.parametrize(
    "pattern, message",
    [
        (
            "MEG",
            r"not supported yet: Gated DeltaNet layers \('G'\) in hybrid_layer_pattern 'MEG'; build the model "
            r"from 'M' \(Mamba\), '\*' \(attention\), '-' \(MLP\) and 'E' \(MoE\) layers",
        ),
        ("MD", r"DeepSeek sparse-attention layers \('D'\)"),
        ("M+", r"multi-latent attention layers \('\+'\)"),
        ("M*/M*", r"multi-token prediction \('/M\*' x 1\)"),
    ],
)
def test_layer_types_not_built_are_refused(pattern, message):
    with pytest.raises(ValueError, match=message):
        refuse_layer_types_not_built(pattern)


def test_layer_types_built_pass():
    refuse_layer_types_not_built("M*-|M-")
    refuse_layer_types_not_built("M*E-|ME")
    refuse_layer_types_not_built(None)


@pytest.mark.parametrize(
    "args, expected",
    [
        ((8, 0.25, 0.0), "MM*MM*MM"),
        ((8, 0.0, 0.5), "M-M-M-M-"),
        ((10, 0.1, 0.4), "M-MM-*M-M-"),
        ((4, 0.0, 0.0), "MMMM"),
        ((4, 0.5, 0.5), "-**-"),
    ],
)
def test_pattern_from_ratios(args, expected):
    pattern = pattern_from_ratios(*args)
    assert pattern == expected
    num_layers, attention, mlp = args
    counts = get_hybrid_layer_counts(pattern)
    assert counts["*"] == round(num_layers * attention) and counts["-"] == round(num_layers * mlp)


def test_pattern_from_ratios_gives_the_8b_pattern():
    # The published 8B pattern is what the ratio flags of its original launch script (4 and 28 of 56) produce.
    assert pattern_from_ratios(56, 4 / 56, 28 / 56) == PATTERN_8B


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 0.1, 0.1), r"num_layers must be a positive integer, got 0"),
        ((4, -0.1, 0.0), r"attention_ratio must be in \[0, 1\], got -0.1"),
        ((4, 0.0, 1.5), r"mlp_ratio must be in \[0, 1\], got 1.5"),
        ((4, 0.6, 0.6), r"attention_ratio \(0.6\) \+ mlp_ratio \(0.6\) must be at most 1"),
    ],
)
def test_pattern_from_ratios_errors(args, message):
    with pytest.raises(ValueError, match=message):
        pattern_from_ratios(*args)


def test_select_segments_with_pipes():
    pattern = "M*-|M-|MM|-*"
    assert select_pipeline_segment(pattern, FakeGroup(0, 2), 0) == (["M", "*", "-"], 0)
    assert select_pipeline_segment(pattern, FakeGroup(1, 2), 0) == (["M", "-"], 3)
    assert select_pipeline_segment(pattern, FakeGroup(0, 2), 1) == (["M", "M"], 5)
    assert select_pipeline_segment(pattern, FakeGroup(1, 2), 1) == (["-", "*"], 7)
    assert select_pipeline_segment("M*|M", FakeGroup(1, 2), None) == (["M"], 2)


def test_select_without_pipes_splits_like_a_transformer():
    assert select_pipeline_segment("M*-M", None, None) == (list("M*-M"), 0)
    assert select_pipeline_segment("M*-M", FakeGroup(1, 2), None) == (["-", "M"], 2)
    assert select_pipeline_segment("M*-MMM", FakeGroup(0, 2), None, first_stage_layers=1) == (["M"], 0)
    assert select_pipeline_segment("M*-MMM", FakeGroup(1, 2), None, first_stage_layers=1) == (list("*-MMM"), 1)


@pytest.mark.parametrize(
    "pattern, rank, size, vp_stage, kwargs, message",
    [
        ("M*|M", 0, 2, None, {"first_stage_layers": 1}, r"sets the pipeline stages with '\|'; do not also set"),
        (
            "M*|M|M",
            0,
            2,
            None,
            {},
            r"has 3 pipe-separated segments, not divisible by pipeline_model_parallel_size \(2\)",
        ),
        ("M*|M", 0, 2, 1, {}, r"virtual stage 1 needs segment 2 but the pattern has 2"),
        ("M*MM", 0, 2, 0, {}, r"has no '\|' separators, so it cannot be split into virtual pipeline stages"),
        ("M*M", 0, 2, None, {}, r"num_layers \(3\) is not divisible by pipeline_model_parallel_size \(2\)"),
    ],
)
def test_select_errors(pattern, rank, size, vp_stage, kwargs, message):
    with pytest.raises(ValueError, match=message):
        select_pipeline_segment(pattern, FakeGroup(rank, size), vp_stage, **kwargs)


def test_layer_maps_number_each_type_separately():
    maps = get_layer_maps_from_layer_type_list(list("M*M-*"))
    assert maps["M"] == {0: 0, 2: 1} and maps["*"] == {1: 0, 4: 1} and maps["-"] == {3: 0} and maps["E"] == {}


def test_deprecated_settings_resolve_with_warnings():
    assert resolve_hybrid_layer_pattern(4, "M*M-") == "M*M-"
    with pytest.warns(UserWarning, match="hybrid_override_pattern has been deprecated. Use hybrid_layer_pattern"):
        assert resolve_hybrid_layer_pattern(4, hybrid_override_pattern="M*M-") == "M*M-"
    with pytest.warns(UserWarning, match="hybrid_attention_ratio and hybrid_mlp_ratio have been deprecated"):
        assert resolve_hybrid_layer_pattern(8, hybrid_attention_ratio=0.25) == "MM*MM*MM"
    assert resolve_hybrid_layer_pattern(3) == "MMM"  # no pattern and no ratios: all Mamba, as in Megatron


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"hybrid_layer_pattern": "M*", "hybrid_override_pattern": "M*"},
            r"hybrid_override_pattern and hybrid_layer_pattern cannot both be set",
        ),
        (
            {"hybrid_layer_pattern": "M*", "hybrid_mlp_ratio": 0.5},
            r"hybrid_layer_pattern cannot be used together with hybrid_attention_ratio or hybrid_mlp_ratio",
        ),
    ],
)
def test_conflicting_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_hybrid_layer_pattern(2, **kwargs)
