"""--pipeline-model-parallel-layout on the command line: it reaches the config, sets the virtual pipeline size, and
every conflict or bad layout is refused naming the flags."""

import re

import pytest

from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.training.arguments import core_transformer_config_from_args
from tests.unit_tests.training.test_arguments import validated

PP2 = ("--pipeline-model-parallel-size", "2")


def test_layout_reaches_the_config_and_sets_the_virtual_size():
    args = validated(*PP2, "--pipeline-model-parallel-layout", "Et|tttL", world_size=2)
    assert args.virtual_pipeline_model_parallel_size is None
    config = core_transformer_config_from_args(args)
    assert isinstance(config.pipeline_model_parallel_layout, PipelineParallelLayerLayout)
    assert config.pipeline_model_parallel_layout.layers_per_virtual_stage() == [1, 3]
    interleaved = validated(*PP2, "--pipeline-model-parallel-layout", "E|tt|t|tL", world_size=2)
    assert interleaved.virtual_pipeline_model_parallel_size == 2
    assert core_transformer_config_from_args(interleaved).virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ("--num-virtual-stages-per-pipeline-rank", "2"),
            "--pipeline-model-parallel-layout cannot be combined with --num-virtual-stages-per-pipeline-rank",
        ),
        (
            ("--decoder-first-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"),
            "combined with --decoder-first-pipeline-num-layers, --account-for-loss-in-pipeline-split; the layout",
        ),
    ],
)
def test_conflicting_split_flags_are_refused(extra, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validated(*PP2, "--pipeline-model-parallel-layout", "Et|tttL", *extra, world_size=2)


@pytest.mark.parametrize(
    "pp, layout, extra, message",
    [
        ("2", "Et|tt|tL", (), "--pipeline-model-parallel-layout has 3 stages, not a multiple of "),
        ("2", "Et|ttL", (), "--pipeline-model-parallel-layout has 3 decoder layers ('t') but --num-layers is 4"),
        ("2", "Et|ttq|L", (), "invalid layer character 'q'"),
        ("1", "Et|tttL", (), "gives 2 stages on one pipeline rank; virtual stages need --pipeline-model-parallel-size"),
        (
            "2",
            "E|tt|t|tL",
            ("--no-overlap-p2p-communication",),
            "the interleaved schedule with --no-overlap-p2p-communication needs --pipeline-model-parallel-size > 2",
        ),
    ],
)
def test_bad_layouts_name_the_flags(pp, layout, extra, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validated(
            "--pipeline-model-parallel-size", pp, "--pipeline-model-parallel-layout", layout, *extra, world_size=int(pp)
        )
