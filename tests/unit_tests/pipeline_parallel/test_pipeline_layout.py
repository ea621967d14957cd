"""Which layers each (virtual) pipeline stage builds: even, uneven first/last, embedding/loss accounting, chunks."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import (
    get_num_layers_to_build,
    get_transformer_layer_offset,
    layers_per_virtual_stage,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(num_layers, pp, vp=None, **overrides):
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32,
        **overrides,
    )


def _layout(config):
    """``[(pp_rank, vp_stage, first_layer, num_layers), ...]`` in virtual-stage order."""
    pp, vp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    stages = []
    try:
        for chunk in range(vp or 1):
            for rank in range(pp):
                parallel_state.set_pipeline_model_parallel_rank(rank)
                vp_stage = chunk if vp else None
                first = get_transformer_layer_offset(config, vp_stage)
                stages.append((rank, vp_stage, first, get_num_layers_to_build(config, vp_stage)))
    finally:
        parallel_state.set_pipeline_model_parallel_rank(None)
    return stages


def _slices(config):
    return [(first, count) for _, _, first, count in _layout(config)]


def test_even_split():
    assert _slices(_config(8, 4)) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert _slices(_config(3, 1)) == [(0, 3)]


def test_virtual_chunks_take_slices_round_robin():
    # Chunk 0 of ranks 0, 1, then chunk 1 of ranks 0, 1.
    assert _layout(_config(8, 2, 2)) == [(0, 0, 0, 2), (1, 0, 2, 2), (0, 1, 4, 2), (1, 1, 6, 2)]


def test_uneven_first_and_last_stages():
    first_last = _config(6, 4, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1)
    assert _slices(first_last) == [(0, 1), (1, 2), (3, 2), (5, 1)]
    assert _slices(_config(7, 3, num_layers_in_first_pipeline_stage=1)) == [(0, 1), (1, 3), (4, 3)]
    assert _slices(_config(7, 3, num_layers_in_last_pipeline_stage=3)) == [(0, 2), (2, 2), (4, 3)]


def test_uneven_stages_with_virtual_chunks():
    # Stages hold 2, 6, 2 layers, i.e. 1, 3, 1 per chunk.
    config = _config(10, 3, 2, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)
    assert _slices(config) == [(0, 1), (1, 3), (4, 1), (5, 1), (6, 3), (9, 1)]


def test_embedding_and_loss_count_as_layers():
    both = dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert _slices(_config(6, 4, **both)) == [(0, 1), (1, 2), (3, 2), (5, 1)]
    assert _slices(_config(7, 4, account_for_embedding_in_pipeline_split=True)) == [(0, 1), (1, 2), (3, 2), (5, 2)]
    assert _slices(_config(6, 2, 2, **both)) == [(0, 1), (1, 2), (3, 2), (5, 1)]


@pytest.mark.parametrize(
    "num_layers,pp,vp,extra",
    [
        (12, 2, 3, {}),
        (12, 3, 2, {}),
        (8, 4, 2, {"num_layers_in_first_pipeline_stage": 2}),
        (14, 4, 2, {"num_layers_in_first_pipeline_stage": 4, "num_layers_in_last_pipeline_stage": 2}),
        (10, 3, 2, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}),
    ],
)
def test_every_layer_is_built_exactly_once_in_order(num_layers, pp, vp, extra):
    position = 0
    for _, _, first, count in _layout(_config(num_layers, pp, vp, **extra)):
        assert first == position
        position += count
    assert position == num_layers


ERRORS = [
    (dict(num_layers=5, pp=2), r"num_layers \(5\) is not divisible by pipeline_model_parallel_size \(2\)"),
    (
        dict(num_layers=5, pp=4, account_for_loss_in_pipeline_split=True),
        r"num_layers \(5\) \+ embedding/loss \(1\) = 6 is not divisible by pipeline_model_parallel_size \(4\)",
    ),
    (dict(num_layers=6, pp=2, vp=2), r"pipeline stage 0 has 3 layers, not divisible by virtual_pipeline_model"),
    (
        dict(num_layers=4, pp=2, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1),
        r"num_layers \(4\) does not match num_layers_in_first_pipeline_stage \(1\) \+ num_layers_in_last",
    ),
    (
        dict(num_layers=6, pp=4, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=2),
        r"the 3 layers left .* do not divide evenly over the other 2 pipeline stages",
    ),
    (dict(num_layers=4, pp=2, num_layers_in_first_pipeline_stage=0), "must be a positive integer, got 0"),
    (dict(num_layers=4, pp=1, num_layers_in_last_pipeline_stage=2), r"need pipeline_model_parallel_size > 1"),
    (
        dict(num_layers=4, pp=2, num_layers_in_first_pipeline_stage=1, account_for_embedding_in_pipeline_split=True),
        "cannot be combined with account_for_embedding_in_pipeline_split",
    ),
]


def test_the_split_needs_no_process_groups():
    """The pure split (virtual stages in pipeline order) that the config-based functions above are built on."""
    assert layers_per_virtual_stage(8, 2, 2) == [2, 2, 2, 2]
    assert layers_per_virtual_stage(
        10, 3, 2, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2
    ) == [1, 3, 1, 1, 3, 1]
    assert layers_per_virtual_stage(
        6, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True
    ) == [1, 2, 2, 1]


@pytest.mark.parametrize(
    "num_layers, pp, message",
    [
        (0, 2, "num_layers must be a positive integer, got 0"),
        (4, 0, "pipeline_model_parallel_size must be a positive integer, got 0"),
    ],
)
def test_the_split_needs_positive_sizes(num_layers, pp, message):
    with pytest.raises(ValueError, match=message):
        layers_per_virtual_stage(num_layers, pp)


@pytest.mark.parametrize("fields,message", ERRORS)
def test_bad_layouts_are_explained(fields, message):
    fields = dict(fields)
    config = _config(fields.pop("num_layers"), fields.pop("pp"), fields.pop("vp", None), **fields)
    with pytest.raises(ValueError, match=message):
        _layout(config)


@pytest.mark.parametrize("vp_stage", [None, 2])
def test_virtual_stages_need_a_valid_vp_stage(vp_stage):
    with pytest.raises(ValueError, match=rf"needs the model chunk's vp_stage \(0 .. 1\), got {vp_stage}"):
        get_num_layers_to_build(_config(8, 2, 2), vp_stage)
