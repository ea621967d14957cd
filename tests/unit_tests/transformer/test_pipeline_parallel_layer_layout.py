"""PipelineParallelLayerLayout: Megatron's layout strings, the stages and offsets they give, every error, the config
rules, and GPT models split by a layout on 2 gloo ranks matching one process (losses, gradients, after SGD steps)."""

import dataclasses
import re

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.models.gpt_test_helpers import relative_error
from tests.unit_tests.pipeline_parallel import gpt_pipeline_helpers as gpt
from tests.unit_tests.test_utilities import Utils, run_distributed

E, L, T, M = LayerType.embedding, LayerType.loss, LayerType.decoder, LayerType.mtp


def _config(layout, num_layers=8, pp=4, **overrides):
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_layout=layout,
        **overrides,
    )


@pytest.mark.parametrize(
    "text, stages",
    [
        ("Et|t*4|t|tL", [[E, T], [T] * 4, [T], [T, L]]),
        ("E|t|t*2|t||(t|)*2,t*2,L", [[E], [T], [T, T], [T], [], [T], [T], [T, T, L]]),
        ("Et*3|(tt|)*29,m|L", [[E, T, T, T]] + [[T, T]] * 29 + [[M], [L]]),
    ],
)
def test_parse_string(text, stages):
    assert PipelineParallelLayerLayout.parse_str_to_list(text) == stages
    assert PipelineParallelLayerLayout.get_num_stages_from_str(text) == len(stages)
    names = [[layer.name for layer in stage] for stage in stages]
    pp = 2 if len(stages) % 2 == 0 else 1
    assert PipelineParallelLayerLayout(text, pp).layout == PipelineParallelLayerLayout(names, pp).layout


def test_stages_offsets_and_repr():
    layout = PipelineParallelLayerLayout("E|t|t*2|t||(t|)*2,t*2,L", 4)
    assert layout.virtual_pipeline_model_parallel_size == 2
    assert layout.layers_per_virtual_stage() == [0, 1, 2, 1, 0, 1, 1, 2]
    assert repr(layout) == "E|t|t*2|t||(t|)*2,t*2,L"
    assert (
        repr(PipelineParallelLayerLayout([["embedding", "decoder", "loss"]], 1)) == "[['embedding', 'decoder', 'loss']]"
    )
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    try:
        # Megatron's 1-based golden numbers per (rank, chunk): [[], []], [[1], [5]], [[2, 3], [6]], [[4], [7, 8]].
        ids = [[layout.get_layer_id_list(vp_stage=c, pp_rank=r) for c in range(2)] for r in range(4)]
        assert ids == [[[], []], [[0], [4]], [[1, 2], [5]], [[3], [6, 7]]]
        assert layout.get_num_layers_to_build(LayerType.loss, vp_stage=1, pp_rank=3) == 1
        with pytest.raises(ValueError, match="vp_stage must be passed when virtual pipeline parallelism is on"):
            layout.get_layer_offset(pp_rank=0)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    assert layout.pretty_repr().splitlines() == [
        "                 VPP rank 0        VPP rank 1",
        "PP rank 0        embedding         (empty stage)",
        "PP rank 1        decoder           decoder",
        "PP rank 2        decoder*2         decoder",
        "PP rank 3        decoder           decoder*2,loss",
    ]
    assert PipelineParallelLayerLayout("Ett|tt|tt|ttL", 4).pretty_repr().splitlines() == [
        "PP rank 0          embedding,decoder*2",
        "PP rank 1-2        decoder*2",
        "PP rank 3          decoder*2,loss",
    ]


@pytest.mark.parametrize(
    "layout, pp, message",
    [
        ("Et|tx|L", 3, "invalid layer character 'x' in stage 'tx'; known layer characters: ['E', 'L', 't', 'm']"),
        ("Et|t|tL", 2, "has 3 stages, not a multiple of pipeline_model_parallel_size (2)"),
        ([["embedding"], [["decoder"]]], 2, "must be LayerType values or their names, got list ['decoder']"),
        ([["embedding"], ["decoder", "cake"], ["loss"]], 1, "'cake' is not a valid LayerType; use one of"),
        ("Et|tL", 0, "not a multiple of pipeline_model_parallel_size (0)"),
        ("nonsense-free", 1, "invalid layer character"),
        ([["embedding"], "tt"], 1, "must be a layout string or a list of lists (one per stage)"),
    ],
)
def test_construction_errors(layout, pp, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PipelineParallelLayerLayout(layout, pp)


@pytest.mark.parametrize(
    "layout, num_layers, message",
    [
        ("tt|tL", 3, "the first layer must be embedding ('E'), got decoder"),
        ("|", 0, "the first layer must be embedding ('E'), got nothing"),
        ("Ett|tt", 4, "the last layer must be loss ('L'), got decoder"),
        ("EtE|tL", 2, "embedding ('E') must appear exactly once, it appears 2 times"),
        ("Et|LtL", 2, "loss ('L') must appear exactly once, it appears 2 times"),
        ("Et|tL", 3, "has 2 decoder layers ('t') but num_layers is 3; make them equal"),
        ("Et|tmL", 2, "has 1 MTP layers ('m') but mtp_num_layers is None; make them equal"),
        ([["embedding", "encoder"], ["decoder", "loss"]], 1, "encoder layers are not supported"),
    ],
)
def test_layer_errors(layout, num_layers, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PipelineParallelLayerLayout(layout, 2).validate_layer_layout(num_layers, None)


@pytest.mark.parametrize(
    "layout, pp, message, standalone",
    [
        ("Et|mt|tL", 3, "decoder layers must be placed before the MTP layers", None),
        ("Et|m|L|", 2, "MTP layers must be in the last virtual stage of their rank (rank 1 holds", None),
        ("Ett|m|m|L", 4, "all MTP layers must be in one virtual stage", None),
        ("Ett|tmm|L", 3, None, True),
        ("Ett|ttmmL", 2, None, False),
    ],
)
def test_mtp_rules(layout, pp, message, standalone):
    parsed = PipelineParallelLayerLayout(layout, pp)
    counts = (parsed.flatten_layout.count(T), parsed.flatten_layout.count(M))
    if message is None:
        assert parsed.validate_layer_layout(*counts) is standalone
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            parsed.validate_layer_layout(*counts)


def test_config_takes_the_layout_and_its_virtual_size():
    config = _config("E|t|t*2|t||(t|)*2,t*2,L")
    assert isinstance(config.pipeline_model_parallel_layout, PipelineParallelLayerLayout)
    assert config.virtual_pipeline_model_parallel_size == 2
    again = dataclasses.replace(config)
    assert again.pipeline_model_parallel_layout is config.pipeline_model_parallel_layout
    listed = _config([["embedding", "decoder"], ["decoder", "loss"]], num_layers=2, pp=2)
    assert listed.virtual_pipeline_model_parallel_size is None
    assert listed.pipeline_model_parallel_layout.layers_per_virtual_stage() == [1, 1]


@pytest.mark.parametrize(
    "layout, overrides, message",
    [
        (
            "Ett|ttL",
            {"num_layers_in_first_pipeline_stage": 2},
            "cannot be set with other pipeline layout arguments (num_layers_in_first_pipeline_stage=2)",
        ),
        (
            "Ett|ttL",
            {"account_for_loss_in_pipeline_split": True},
            "(account_for_loss_in_pipeline_split=True); the layout places every layer itself",
        ),
        (
            "Et|t|t|tL",
            {"virtual_pipeline_model_parallel_size": 3},
            "virtual_pipeline_model_parallel_size=3, the layout gives 2 stages per pipeline rank",
        ),
        ("Et|tt|tL", {"pipeline_model_parallel_size": 1}, "has 3 stages but pipeline_model_parallel_size is 1"),
        (
            PipelineParallelLayerLayout("Et|tttL", 2),
            {"pipeline_model_parallel_size": 4},
            "was built for pipeline_model_parallel_size=2, but the config has 4",
        ),
        (("E", "t", "L"), {}, "must be a layout string, a list of stages or a PipelineParallelLayerLayout, got tuple"),
    ],
)
def test_config_errors(layout, overrides, message):
    fields = {"num_layers": 4, "pp": 2, **overrides}
    fields["pp"] = fields.pop("pipeline_model_parallel_size", fields["pp"])
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(layout, **fields)


# name: (layout, virtual stages per rank); every one splits the same 4-layer GPT over 2 pipeline ranks.
LAYOUTS = {"default_equivalent": ("Ett|ttL", None), "uneven": ("Et|tttL", None), "interleaved": ("E|tt|t|tL", 2)}
NUM_LAYERS, MICROBATCHES, SGD_STEPS = 4, 4, 2


def _train(chunks, batches):
    """Losses and gradients of one step, then the losses after SGD steps."""
    losses = gpt.run_schedule(chunks, batches, MICROBATCHES)
    grads = gpt.stage_gradients(chunks)
    optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.5)
    for _ in range(SGD_STEPS):
        optimizer.step()
        optimizer.zero_grad()
        trained = gpt.run_schedule(chunks, batches, MICROBATCHES)
    return losses, grads, trained


def _reference():
    Utils.initialize_model_parallel(1, 1)
    model = gpt.build_full_model(1, False, "gpt2", NUM_LAYERS)
    model.config.finalize_model_grads_func = gpt.finalize_model_grads
    losses, grads, trained = _train([model], gpt.microbatches(MICROBATCHES))
    return {"losses": losses, "grads": grads, "trained": trained}


def _run_layouts():
    results = {}
    for name, (layout, vp) in LAYOUTS.items():
        Utils.initialize_model_parallel(1, 2, vp)
        full = gpt.build_full_model(1, False, "gpt2", NUM_LAYERS)
        chunks, _ = gpt.build_stage_chunks(1, False, "gpt2", NUM_LAYERS, 2, vp, pipeline_model_parallel_layout=layout)
        gpt.copy_weights(full, chunks)
        losses, grads, trained = _train(chunks, gpt.microbatches(MICROBATCHES))
        results[name] = {
            "layer_numbers": [[layer.layer_number for layer in c.decoder.layers] for c in chunks],
            "losses": losses,
            "grads": grads,
            "trained": trained,
        }
    Utils.initialize_model_parallel(1, 2)
    default, _ = gpt.build_stage_chunks(1, False, "gpt2", NUM_LAYERS, 2)
    results["default_layer_numbers"] = [[layer.layer_number for layer in c.decoder.layers] for c in default]
    return results


@pytest.fixture(scope="module")
def runs():
    return run_distributed(2, _run_layouts, timeout=300), run_distributed(1, _reference, timeout=300)[0]


def test_layouts_place_layers_as_written(runs):
    ranks, _ = runs
    assert [r["default_equivalent"]["layer_numbers"] for r in ranks] == [r["default_layer_numbers"] for r in ranks]
    assert [r["uneven"]["layer_numbers"] for r in ranks] == [[[1]], [[2, 3, 4]]]
    assert [r["interleaved"]["layer_numbers"] for r in ranks] == [[[], [3]], [[1, 2], [4]]]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_one_process(runs, name):
    ranks, reference = runs
    last = ranks[1][name]
    assert ranks[0][name]["losses"] == [] and len(last["losses"]) == MICROBATCHES
    for key in ("losses", "trained"):
        for got, want in zip(last[key], reference[key]):
            assert relative_error(got["lm loss"], want["lm loss"]) <= 1e-5, key
    seen = set()
    for rank in ranks:
        for param_name, grad in rank[name]["grads"].items():
            assert relative_error(grad, reference["grads"][param_name]) <= 1e-5, param_name
            seen.add(param_name)
    assert seen == set(reference["grads"])
