"""HF <-> Megatron conversion, per family: HF -> Megatron (in memory, and through a converted torch_dist checkpoint)
gives HF's logits at TP1, TP2 and PP2; Megatron -> HF gives back every tensor bit for bit and HF's logits."""

import json
import os

import pytest
import torch

from tests.unit_tests.models.huggingface.hf_test_models import (
    CONFIGS,
    VOCAB,
    hf_logits,
    relative_error,
    save_hf_model,
    tokens,
)
from tests.unit_tests.test_utilities import run_distributed

FAMILIES = sorted(CONFIGS)
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def _convert_to_megatron(hf_dir, out_dir, tp, pp):
    from megatron.core.models.huggingface import save_megatron_checkpoint_from_hf

    return save_megatron_checkpoint_from_hf(hf_dir, out_dir, tp, pp)


def _export_to_hf(megatron_dir, out_dir, max_shard_bytes):
    from megatron.core.models.huggingface import export_megatron_checkpoint_to_hf

    return export_megatron_checkpoint_to_hf(megatron_dir, out_dir, max_shard_bytes)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per family: the HF directory, its logits on a fixed batch, and its Megatron conversion (args TP 2)."""
    root = tmp_path_factory.mktemp("hf_families")
    input_ids = tokens()
    found = {}
    for family in FAMILIES:
        hf_dir = save_hf_model(family, str(root / family))
        megatron_dir = str(root / f"{family}_megatron")
        run_distributed(1, _convert_to_megatron, hf_dir, megatron_dir, 2, 1)
        found[family] = dict(hf_dir=hf_dir, megatron_dir=megatron_dir, logits=hf_logits(hf_dir, input_ids))
    return input_ids, found


def _forward(model, input_ids):
    """Logits of this pipeline stage's model for the whole batch on the last stage (TP-gathered), None elsewhere."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(input_ids.shape[1], input_ids.shape[0], model.config.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        output = model(input_ids, positions, None)
        if not ps.is_pipeline_last_stage():
            dist.send(output.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    group = ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(output) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, output.contiguous(), group=group)
    return torch.cat(shards, dim=-1)[..., :VOCAB] if ps.get_tensor_model_parallel_rank() == 0 else None


def _logits_at_layout(hf_dir, megatron_dir, input_ids, tp, pp):
    """(logits of the model filled in memory from HF, of the model loaded from the converted checkpoint, HF state
    dict exported from the in-memory model at TP1) at this layout."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.huggingface import build_gpt_model_from_hf, hf_state_dict_from_model
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1)
    stage = dict(
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    in_memory = build_gpt_model_from_hf(hf_dir, **stage).eval()
    from_checkpoint = build_gpt_model_from_hf(hf_dir, load_weights=False, **stage).eval()
    state = dist_checkpointing.load(
        {"model": from_checkpoint.sharded_state_dict()}, os.path.join(megatron_dir, "release")
    )
    from_checkpoint.load_state_dict(state["model"])
    exported = hf_state_dict_from_model(in_memory, hf_dir=hf_dir) if tp == pp == 1 else None
    return _forward(in_memory, input_ids), _forward(from_checkpoint, input_ids), exported


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_model_gives_hf_logits(models, family, layout):
    input_ids, found = models
    tp, pp = LAYOUTS[layout]
    entry = found[family]
    results = run_distributed(tp * pp, _logits_at_layout, entry["hf_dir"], entry["megatron_dir"], input_ids, tp, pp)
    last = [r for r in results if r[0] is not None]
    assert len(last) == 1
    in_memory, from_checkpoint, exported = last[0]
    assert relative_error(in_memory, entry["logits"]) <= 1e-5, f"{family} {layout}: in-memory load"
    assert relative_error(from_checkpoint, entry["logits"]) <= 1e-5, f"{family} {layout}: converted checkpoint"
    if exported is not None:  # Megatron model in memory -> HF state dict: the source tensors, bit for bit
        from safetensors.torch import load_file

        source = load_file(os.path.join(entry["hf_dir"], "model.safetensors"))
        assert sorted(exported) == sorted(source)
        assert all(torch.equal(exported[name], source[name]) for name in source)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_gives_back_every_tensor_and_hf_logits(models, family, tmp_path):
    from safetensors.torch import load_file

    input_ids, found = models
    entry = found[family]
    out = str(tmp_path / "exported")
    written = run_distributed(1, _export_to_hf, entry["megatron_dir"], out, 5 * 10**9)[0]
    assert "model.safetensors" in written and "config.json" in written
    source = load_file(os.path.join(entry["hf_dir"], "model.safetensors"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(exported) == sorted(source)
    for name in source:
        assert exported[name].dtype == source[name].dtype and torch.equal(exported[name], source[name]), name
    with open(os.path.join(entry["hf_dir"], "config.json")) as file:
        source_config = json.load(file)
    with open(os.path.join(out, "config.json")) as file:
        exported_config = json.load(file)
    for key in (
        "architectures",
        "hidden_size",
        "n_embd",
        "num_key_value_heads",
        "head_dim",
        "rope_parameters",
        "rms_norm_eps",
        "layer_norm_epsilon",
        "tie_word_embeddings",
        "vocab_size",
        "activation_function",
    ):
        if key in source_config:
            assert exported_config[key] == source_config[key], key
    assert torch.equal(hf_logits(out, input_ids), entry["logits"])


def test_export_shards_above_the_size_threshold(models, tmp_path):
    """A small --max-shard-size: several files and an index, which transformers loads."""
    from safetensors.torch import load_file

    input_ids, found = models
    entry = found["llama"]
    out = str(tmp_path / "sharded")
    written = run_distributed(1, _export_to_hf, entry["megatron_dir"], out, 20_000)[0]
    shards = [name for name in written if name.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors" not in os.listdir(out)
    with open(os.path.join(out, "model.safetensors.index.json")) as file:
        weight_map = json.load(file)["weight_map"]
    assert sorted(set(weight_map.values())) == sorted(shards)
    source = load_file(os.path.join(entry["hf_dir"], "model.safetensors"))
    assert sorted(weight_map) == sorted(source)
    for shard in shards:
        for name, tensor in load_file(os.path.join(out, shard)).items():
            assert weight_map[name] == shard and torch.equal(tensor, source[name])
    assert torch.equal(hf_logits(out, input_ids), entry["logits"])


def test_sharded_hf_input_reads_like_one_file(models, tmp_path):
    """An HF directory with model.safetensors.index.json (as save_pretrained shards large models) converts to the
    same checkpoint: exporting that again gives the source tensors."""
    from safetensors.torch import load_file

    _, found = models
    entry = found["qwen2"]
    sharded_hf = str(tmp_path / "sharded_hf")
    run_distributed(1, _export_to_hf, entry["megatron_dir"], sharded_hf, 20_000)
    megatron_dir = str(tmp_path / "again")
    run_distributed(1, _convert_to_megatron, sharded_hf, megatron_dir, 1, 1)
    out = str(tmp_path / "out")
    run_distributed(1, _export_to_hf, megatron_dir, out, 5 * 10**9)
    source = load_file(os.path.join(entry["hf_dir"], "model.safetensors"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(exported) == sorted(source) and all(torch.equal(exported[n], source[n]) for n in source)


def test_converted_checkpoint_layout_and_args(models):
    """The checkpoint is a Megatron training checkpoint: tracker + release/, torch_dist, the common state inside the
    DCP files, stacked layer keys with TE norm names, the vocabulary padded for the target TP, args for
    --use-checkpoint-args."""
    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata

    _, found = models
    megatron_dir = found["llama"]["megatron_dir"]
    with open(os.path.join(megatron_dir, "latest_checkpointed_iteration.txt")) as file:
        assert file.read() == "release"
    checkpoint = os.path.join(megatron_dir, "release")
    assert not os.path.exists(os.path.join(checkpoint, "common.pt"))
    with open(os.path.join(checkpoint, "metadata.json")) as file:
        assert json.load(file)["sharded_backend"] == "torch_dist"
    stored = read_dcp_metadata(checkpoint).state_dict_metadata
    assert "common_state/shard_0_1" in stored
    qkv = stored["decoder.layers.self_attention.linear_qkv.weight"].size
    assert tuple(qkv) == (2, (4 + 2 * 2) * 8, 32)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in stored
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in stored
    assert tuple(stored["embedding.word_embeddings.weight"].size) == (256, 32)  # 100 padded to 128 x TP 2
    common = load_common_state_dict(checkpoint)
    assert common["checkpoint_version"] == 3.0 and "optimizer" not in common and "rng_state" not in stored
    args = common["args"]
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.group_query_attention) == (2, 32, 2, True)
    assert (args.tensor_model_parallel_size, args.padded_vocab_size) == (2, 256)
    assert (args.swiglu, args.normalization, args.layernorm_epsilon) == (True, "RMSNorm", 1e-6)
    assert (args.rotary_base, args.use_rope_scaling, args.rope_scaling_factor) == (500000, True, 8.0)
    assert args.untie_embeddings_and_output_weights and args.position_embedding_type == "rope"
