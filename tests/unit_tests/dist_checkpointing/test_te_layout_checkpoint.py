"""The Transformer Engine layer spec without Transformer Engine: checkpoint keys equal to those Megatron-Core's own
Transformer Engine models write (golden_gpt_te_spec_keys.txt, generated from Megatron by
tools/checkpoint/megatron_te_spec_keys.py), checkpoints that load back with identical logits, cross-loading with the
local spec, and the one message that says which modules are built."""

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import te_layout
from tests.unit_tests.dist_checkpointing import gpt_checkpoint_helpers as helpers
from tests.unit_tests.models.gpt_test_helpers import SEQ, VOCAB, batch, build_config
from tests.unit_tests.test_utilities import run_distributed
from tools.checkpoint.megatron_te_spec_keys import TP, _listing

GOLDEN = Path(__file__).with_name("golden_gpt_te_spec_keys.txt")


def read_golden() -> dict:
    """section name -> (settings, state_dict() keys, checkpoint key lines)."""
    sections, current = {}, None
    for line in GOLDEN.read_text().splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {"lines": []})
        elif line.startswith("{"):
            current["settings"] = json.loads(line)
        elif line.startswith("# state_dict(): "):
            current["state_dict"] = line.split(": ", 1)[1].split()
        elif line and not line.startswith("#"):
            current["lines"].append(line)
    return sections


def te_spec_model(settings: dict, tp: int, seed: int = 1) -> GPTModel:
    """Our GPTModel from the Transformer Engine spec with a golden section's settings."""
    model_parallel_cuda_manual_seed(seed)
    fields = dict(settings["config"])
    if "activation_func" in fields:
        fields["activation_func"] = getattr(F, fields["activation_func"])
    # Our MoE layers need sequence parallelism under TP (Megatron's build does not check); keys do not change.
    config = build_config(tp, tp > 1 and "num_moe_experts" in fields, fields)
    spec_kwargs = settings["spec"]
    if spec_kwargs.get("num_experts"):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    else:
        spec = get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, **settings["model"])


def _our_listings(sections):
    parallel_state.initialize_model_parallel(TP, 1)
    results = {}
    for name, section in sections.items():
        model = te_spec_model(section["settings"], TP)
        results[name] = (helpers.describe_pieces(model.sharded_state_dict()), sorted(model.state_dict()))
    return results


def test_te_spec_checkpoint_keys_shapes_and_sharding_are_megatrons():
    golden = read_golden()
    by_rank = run_distributed(TP, _our_listings, golden)
    for name, section in golden.items():
        actual = _listing([rank[name][0] for rank in by_rank])
        assert actual == section["lines"], f"[{name}] differs from {GOLDEN.name}; got:\n" + "\n".join(actual)
        assert by_rank[0][name][1] == sorted(section["state_dict"]), f"[{name}] state_dict() keys differ"


# ---- save and load ----------------------------------------------------------------------------------------------

GPT = {"config": {"add_bias_linear": True}, "model": {"position_embedding_type": "learned_absolute"}, "spec": {}}
LLAMA = {
    "config": {
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": "silu",
        "num_query_groups": 4,
        "qk_layernorm": True,
    },
    "model": {"position_embedding_type": "rope", "share_embeddings_and_output_weights": True},
    "spec": {"qk_layernorm": True},
}


def local_spec_model(settings: dict, seed: int) -> GPTModel:
    model_parallel_cuda_manual_seed(seed)
    fields = dict(settings["config"])
    if "activation_func" in fields:
        fields["activation_func"] = getattr(F, fields["activation_func"])
    config = build_config(1, False, fields)
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, **settings["model"])


def _build(settings: dict, layout: str, seed: int) -> GPTModel:
    return te_spec_model(settings, 1, seed) if layout == "te" else local_spec_model(settings, seed)


def _logits(model: GPTModel) -> torch.Tensor:
    tokens, position_ids, _ = batch()
    model.eval()
    with torch.no_grad():
        return model(tokens, position_ids, attention_mask=None)


def _save_and_load(settings: dict, source_layout: str, target_layout: str, checkpoint_dir: str):
    parallel_state.initialize_model_parallel(1, 1)
    source = _build(settings, source_layout, seed=1)
    dist_checkpointing.save(source.sharded_state_dict(), checkpoint_dir)
    target = _build(settings, target_layout, seed=2)
    before = _logits(target)
    loaded = dist_checkpointing.load(target.sharded_state_dict(), checkpoint_dir)
    target.load_state_dict(loaded)
    # The output layer is a local linear in both specs (as in Megatron), with an empty extra state of None.
    extra_states = sorted(
        {
            type(value).__name__
            for key, value in target.state_dict().items()
            if key.endswith("_extra_state") and not key.startswith("output_layer.")
        }
    )
    return torch.equal(_logits(target), _logits(source)), torch.equal(before, _logits(source)), extra_states


@pytest.mark.parametrize("settings", [GPT, LLAMA], ids=["gpt", "llama_qk_layernorm"])
@pytest.mark.parametrize("source,target", [("te", "te"), ("te", "local"), ("local", "te")])
def test_checkpoints_load_across_layouts_with_identical_logits(tmp_path, settings, source, target):
    same, same_before_loading, extra_states = run_distributed(
        1, _save_and_load, settings, source, target, str(tmp_path)
    )[0]
    assert not same_before_loading, "the models must differ before loading, or the test proves nothing"
    assert same
    # Our Transformer Engine layout writes Transformer Engine's empty byte tensors; the local spec writes None.
    assert extra_states == (["Tensor"] if target == "te" else ["NoneType"])


def _extra_state_storage(checkpoint_dir: str):
    parallel_state.initialize_model_parallel(1, 1)
    model = te_spec_model(GPT, 1)
    dist_checkpointing.save(model.sharded_state_dict(), checkpoint_dir)
    request = {
        "qkv": [
            ShardedObject("decoder.layers.self_attention.linear_qkv._extra_state", None, (2,), (layer,))
            for layer in range(2)
        ],
        "final": ShardedObject("decoder.final_layernorm._extra_state", None, (1,), (0,)),
    }
    loaded = dist_checkpointing.load(request, checkpoint_dir)
    return [(value.dtype, tuple(value.shape)) for value in [*loaded["qkv"], loaded["final"]]]


def test_extra_state_is_stored_as_transformer_engines_empty_byte_tensor(tmp_path):
    stored = run_distributed(1, _extra_state_storage, str(tmp_path))[0]
    assert stored == [(torch.uint8, (0,))] * 3


def _fused_norm_linear_parameter_order():
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    config = build_config(1, False, {"add_bias_linear": True})
    layer = te_layout.TELayoutLayerNormColumnParallelLinear(
        64, 96, config=config, init_method=config.init_method, bias=True, gather_output=False
    )
    return [name for name, _ in layer.named_parameters()]


def test_the_fused_norm_registers_before_the_linear_as_in_transformer_engine():
    """Registration order is the distributed optimizer's bucket order (Transformer Engine's LayerNormLinear
    registers layer_norm_weight and layer_norm_bias, then weight and bias), so dp_reshardable checkpoints of
    Megatron's Transformer Engine models line up with ours."""
    order = run_distributed(1, _fused_norm_linear_parameter_order)[0]
    assert order == ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]


# ---- said once ----------------------------------------------------------------------------------------------------


def test_the_te_layout_is_announced_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(te_layout, "_announced", False)
    config = build_config(1, False, {"num_layers": 4, "num_moe_experts": 4, "moe_layer_freq": 2})
    with caplog.at_level(logging.WARNING, logger=te_layout.__name__):
        get_gpt_layer_with_transformer_engine_spec()
        get_gpt_decoder_block_spec(config, use_transformer_engine=True)
        get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)
    messages = [record.getMessage() for record in caplog.records if record.name == te_layout.__name__]
    assert len(messages) == 1
    assert "Transformer Engine is not installed" in messages[0]
    assert "Transformer Engine's checkpoint keys" in messages[0]


def test_use_te_mlp_and_moe_specs_build_the_te_layout_modules():
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    assert get_mlp_module_spec().submodules.linear_fc1 is te_layout.TELayoutLayerNormColumnParallelLinear
    assert (
        get_mlp_module_spec(use_te=False).submodules.linear_fc1 is not te_layout.TELayoutLayerNormColumnParallelLinear
    )
    experts = get_moe_module_spec(num_experts=4, moe_grouped_gemm=True).submodules.experts
    assert experts.submodules.linear_fc1 is te_layout.TELayoutColumnParallelGroupedLinear
    experts = get_moe_module_spec(num_experts=4).submodules.experts
    assert experts.submodules.linear_fc1 is te_layout.TELayoutColumnParallelLinear
