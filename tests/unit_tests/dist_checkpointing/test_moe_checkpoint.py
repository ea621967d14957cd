"""MoE checkpoints: Megatron-Core 0.19's keys and global shapes (each expert at its global index), pieces that tile
every tensor exactly once at any EP / ETP layout, and a checkpoint saved at EP=4 that loads at EP=1, EP=2, ETP=2,
TP2 x EP2 and TP2 without sequence parallelism into models built from another seed, with the same weights and the
same loss afterwards."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_checkpointing.gpt_checkpoint_helpers import describe_pieces
from tests.unit_tests.dist_checkpointing.test_model_sharded_state_dict import key_listing
from tests.unit_tests.models.gpt_test_helpers import relative_error
from tests.unit_tests.test_utilities import Utils, run_distributed

VOCAB, SEQ, BATCH = 64, 8, 2

# Megatron-Core 0.19's tensors for a 2-layer, 4-expert SwiGLU model with SequentialMLP experts and a gated
# shared expert (hidden 16, expert ffn 32, shared ffn 32): routed experts under experts.experts., stacked as
# [layers, experts, ...], with one extra-state object per (layer, expert).
EXPECTED_SEQUENTIAL = """
decoder.final_layernorm.weight tensor [16]
decoder.layers.mlp.experts.experts.linear_fc1._extra_state object [2, 4]
decoder.layers.mlp.experts.experts.linear_fc1.weight tensor [2, 4, 64, 16]
decoder.layers.mlp.experts.experts.linear_fc2._extra_state object [2, 4]
decoder.layers.mlp.experts.experts.linear_fc2.weight tensor [2, 4, 16, 32]
decoder.layers.mlp.linear_fc1.layer_norm_weight tensor [2, 16]
decoder.layers.mlp.router.weight tensor [2, 4, 16]
decoder.layers.mlp.shared_experts.gate_weight tensor [2, 1, 16]
decoder.layers.mlp.shared_experts.linear_fc1._extra_state object [2]
decoder.layers.mlp.shared_experts.linear_fc1.weight tensor [2, 64, 16]
decoder.layers.mlp.shared_experts.linear_fc2._extra_state object [2]
decoder.layers.mlp.shared_experts.linear_fc2.weight tensor [2, 16, 32]
decoder.layers.self_attention.linear_proj._extra_state object [2]
decoder.layers.self_attention.linear_proj.weight tensor [2, 16, 16]
decoder.layers.self_attention.linear_qkv._extra_state object [2]
decoder.layers.self_attention.linear_qkv.layer_norm_weight tensor [2, 16]
decoder.layers.self_attention.linear_qkv.weight tensor [2, 48, 16]
embedding.word_embeddings.weight tensor [64, 16]
output_layer.weight tensor [64, 16]
""".split("\n")[1:-1]


def _config(tp=1, ep=1, etp=None, **overrides):
    overrides.setdefault("sequence_parallel", tp > 1)
    return TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32,
        moe_shared_expert_gate=True,
        moe_aux_loss_coeff=0.01,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type="alltoall",
        **overrides,
    )


def _build(tp=1, ep=1, etp=None, seed=1234, **overrides):
    Utils.initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = _config(tp, ep, etp, **overrides)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def _gather(tensor, param, group):
    if not getattr(param, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    dim, stride = param.partition_dim, param.partition_stride
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def _full_weights(model) -> dict:
    """Whole weights under single-process names, experts by global index, from every rank's pieces."""
    offset = parallel_state.get_expert_model_parallel_rank() * (
        4 // parallel_state.get_expert_model_parallel_world_size()
    )
    dense, experts = {}, {}
    for name, param in model.named_parameters():
        if getattr(param, "allreduce", True):
            dense[name] = _gather(param.detach().clone(), param, parallel_state.get_tensor_model_parallel_group())
        else:
            name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{offset + int(m.group(1))}.", name)
            name = re.sub(r"(weight|bias)(\d+)$", lambda m: f"{m.group(1)}{offset + int(m.group(2))}", name)
            experts[name] = _gather(param.detach().clone(), param, parallel_state.get_expert_tensor_parallel_group())
    parts = [None] * parallel_state.get_expert_model_parallel_world_size()
    dist.all_gather_object(parts, experts, group=parallel_state.get_expert_model_parallel_group())
    for part in parts:
        dense.update(part)
    return dense


def _loss(model) -> float:
    """The mean loss of one fixed batch (eval mode: no aux losses), per data-parallel rank's copy of the batch."""
    model.eval()
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    with torch.no_grad():
        return model(tokens, position_ids, None, labels=labels).mean().item()


def _keys(grouped: bool):
    model = _build(moe_grouped_gemm=grouped)
    sharded = model.sharded_state_dict()
    loaded_keys = sorted(sharded)
    return key_listing(describe_pieces(sharded)), loaded_keys, sorted(model.state_dict())


def test_sequential_mlp_checkpoint_keys_are_megatrons():
    listing, dict_keys, state_keys = run_distributed(1, _keys, False)[0]
    assert listing == EXPECTED_SEQUENTIAL, "\n".join(listing)
    assert dict_keys == [k for k in state_keys if k != "output_layer._extra_state"]


def test_grouped_gemm_checkpoint_keys_are_the_sequential_ones_as_in_megatron():
    listing, _, _ = run_distributed(1, _keys, True)[0]
    assert listing == EXPECTED_SEQUENTIAL, "\n".join(listing)


def _tiling(tp, ep, etp):
    model = _build(tp, ep, etp)
    return describe_pieces(model.sharded_state_dict())


@pytest.mark.parametrize("world,tp,ep,etp", [(4, 1, 4, 1), (4, 2, 2, 2), (4, 2, 2, 1), (2, 1, 1, 2)])
def test_every_element_is_saved_by_exactly_one_rank(world, tp, ep, etp):
    per_rank = run_distributed(world, _tiling, tp, ep, etp)
    shapes, covered = {}, {}
    for pieces in per_rank:
        for kind, key, global_shape, offset, local_shape, main in pieces:
            shapes[key] = global_shape
            if not main:
                continue
            if kind == "object":
                cell = covered.setdefault(key, torch.zeros(global_shape, dtype=torch.int32))
                cell[tuple(offset)] += 1
            else:
                cell = covered.setdefault(key, torch.zeros(global_shape, dtype=torch.int32))
                # local_shape leaves out the prepended (layer, expert) axes, one element each.
                full_local = (1,) * (len(global_shape) - len(local_shape)) + tuple(local_shape)
                index = tuple(slice(o, o + s) for o, s in zip(offset, full_local))
                cell[index] += 1
    assert (
        key_listing([("object" if k.endswith("_extra_state") else "tensor", k, s) for k, s in shapes.items()])
        == EXPECTED_SEQUENTIAL
    )
    for key, counts in covered.items():
        assert (counts == 1).all(), f"{key}: elements saved {counts.unique().tolist()} times"


def _save_at_ep4(directory, grouped):
    model = _build(1, 4, 1, seed=1, moe_grouped_gemm=grouped)
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    return _full_weights(model), _loss(model)


def _load(directory, tp, ep, etp, grouped, sequence_parallel=None):
    sequence_parallel = tp > 1 if sequence_parallel is None else sequence_parallel
    model = _build(tp, ep, etp, seed=2, moe_grouped_gemm=grouped, sequence_parallel=sequence_parallel)
    before = _full_weights(model)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(loaded)
    return before, _full_weights(model), _loss(model)


@pytest.fixture(scope="module", params=[False, True], ids=["sequential", "grouped"])
def saved(request, tmp_path_factory):
    """A checkpoint written at EP=4 (SequentialMLP or grouped-GEMM experts: the same keys, as in Megatron)."""
    directory = tmp_path_factory.mktemp("moe_ep4")
    weights, loss = run_distributed(4, _save_at_ep4, directory, request.param)[0]
    return directory, weights, loss, request.param


@pytest.mark.parametrize("world,tp,ep,etp", [(1, 1, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (4, 2, 2, 2)])
def test_saved_at_ep4_loads_at_other_layouts(saved, world, tp, ep, etp):
    directory, expected, expected_loss, grouped = saved
    for before, after, loss in run_distributed(world, _load, directory, tp, ep, etp, grouped):
        assert after.keys() == expected.keys()
        assert any(relative_error(before[k], expected[k]) > 1e-3 for k in expected)  # built from another seed
        for name, weight in expected.items():
            assert torch.equal(after[name], weight), name
        assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_saved_at_ep4_loads_at_tp2_without_sequence_parallel(saved):
    """Megatron loads and evaluates an MoE checkpoint at TP > 1 without --sequence-parallel: same weights, same
    eval loss."""
    directory, expected, expected_loss, grouped = saved
    for _, after, loss in run_distributed(2, _load, directory, 2, 1, 2, grouped, False):
        for name, weight in expected.items():
            assert torch.equal(after[name], weight), name
        assert loss == pytest.approx(expected_loss, rel=1e-5)


@pytest.mark.parametrize("world,tp,ep,etp", [(2, 1, 2, 1), (2, 1, 1, 2)])
def test_saved_at_ep4_loads_into_the_other_expert_layout(saved, world, tp, ep, etp):
    directory, _, expected_loss, grouped = saved
    for _, _, loss in run_distributed(world, _load, directory, tp, ep, etp, not grouped):
        assert loss == pytest.approx(expected_loss, rel=1e-5)


def _router_state_keys():
    model = _build(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    return key_listing(describe_pieces(model.sharded_state_dict()))


def test_expert_bias_is_saved_and_token_counts_are_not():
    listing = run_distributed(1, _router_state_keys)[0]
    assert "decoder.layers.mlp.router.expert_bias tensor [2, 4]" in listing
    assert not [line for line in listing if "tokens_per_expert" in line]


def _mixed_layer_keys():
    model = _build(moe_layer_freq=[0, 1])
    return [line for line in key_listing(describe_pieces(model.sharded_state_dict())) if "layers" in line]


def test_mixed_dense_and_moe_layers_are_stored_one_key_per_layer():
    """With moe_layer_freq other than 1 the layers differ, so (as in Megatron-Core) each is stored under its own
    global index instead of one stacked key: layer 0 is dense, layer 1 is MoE."""
    listing = run_distributed(1, _mixed_layer_keys)[0]
    assert "decoder.layers.0.mlp.linear_fc1.weight tensor [64, 16]" in listing
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight tensor [16]" in listing
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight tensor [4, 64, 16]" in listing
    assert "decoder.layers.1.mlp.router.weight tensor [4, 16]" in listing
    assert not [line for line in listing if line.startswith("decoder.layers.mlp.")], "\n".join(listing)


def _save_mixed(directory):
    model = _build(1, 2, 1, seed=1, moe_layer_freq=[0, 1])
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    return _full_weights(model), _loss(model)


def _load_mixed(directory):
    model = _build(seed=2, moe_layer_freq=[0, 1])
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
    return _full_weights(model), _loss(model)


def test_mixed_dense_and_moe_layers_saved_at_ep2_load_at_ep1(tmp_path):
    expected, expected_loss = run_distributed(2, _save_mixed, tmp_path)[0]
    weights, loss = run_distributed(1, _load_mixed, tmp_path)[0]
    assert weights.keys() == expected.keys()
    for name, weight in expected.items():
        assert torch.equal(weights[name], weight), name
    assert loss == pytest.approx(expected_loss, rel=1e-5)
