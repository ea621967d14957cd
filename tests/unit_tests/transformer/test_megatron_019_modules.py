"""Behaviour behind the Megatron-Core 0.19 names of the transformer modules: spec utilities, masks and activations,
L2Norm, MLP per-token scaling and SwiGLU checkpoint keys, cross-attention, layer offsets and norm weights, block
feature extraction, Float16Module's fp32_output."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import (
    MegatronModule,
    ModuleSpec,
    TransformerConfig,
    TransformerLayer,
    TransformerLayerSubmodules,
    build_module,
)
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules, SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType, CudaGraphScope, LayerType
from megatron.core.transformer.mlp import MLP, MLPSubmodules, apply_swiglu_sharded_factory
from megatron.core.transformer.module import Float16Module, fp32_to_float16
from megatron.core.transformer.spec_utils import get_submodules
from megatron.core.transformer.torch_norm import L2Norm
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import (
    attention_mask_func,
    erf_gelu,
    get_default_causal_mask,
    get_linear_layer,
    get_sliding_window_causal_mask,
    is_layer_window_attention,
    openai_gelu,
    set_model_to_sequence_parallel,
)
from tests.unit_tests.test_utilities import run_distributed

HIDDEN, HEADS = 16, 4


def _config(**overrides):
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        add_bias_linear=True,
    )
    return TransformerConfig(**{**base, **overrides})


def test_module_spec_metainfo_and_get_submodules():
    spec = ModuleSpec(module=torch.nn.Linear, submodules="subs", metainfo={"fuse_input_layernorm": False})
    assert ModuleSpec(module=torch.nn.Linear).metainfo == {}
    assert get_submodules(spec) == "subs"
    assert get_submodules(functools.partial(MLP.as_mlp_submodule, submodules="from partial")) == "from partial"
    with pytest.raises(KeyError, match="binds no submodules= keyword"):
        get_submodules(functools.partial(MLP))
    with pytest.raises(ValueError, match="has no submodules"):
        get_submodules(MLP)
    # metainfo describes the spec; it is never passed to the module.
    assert isinstance(build_module(ModuleSpec(module=torch.nn.Identity, metainfo={"x": 1})), torch.nn.Identity)
    # A spec is itself a builder; any other callable that is not a class or a function is called.
    assert isinstance(ModuleSpec(module=torch.nn.Linear, params={"bias": False})(2, 3), torch.nn.Linear)
    linear = build_module(functools.partial(torch.nn.Linear, bias=False), 2, 3)
    assert isinstance(linear, torch.nn.Linear) and linear.bias is None


def test_enum_members():
    assert AttnMaskType.causal_bottom_right.name == "causal_bottom_right"
    assert LayerType.mtp.name == "mtp"
    assert [m.name for m in CudaGraphScope][:3] == ["full_iteration", "attn", "mlp"]


def test_masks_and_activations():
    assert torch.equal(get_default_causal_mask(3), torch.tensor([[0, 1, 1], [0, 0, 1], [0, 0, 0]]).bool())
    # Two queries aligned with the last two of four keys, one key to the left visible, none to the right.
    expected = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]]).bool()
    assert torch.equal(get_sliding_window_causal_mask(2, 4, (1, 0)), expected)
    scores = attention_mask_func(torch.zeros(2, 2), torch.tensor([[False, True], [False, False]]))
    assert scores[0, 1] == -10000.0 and scores[1, 1] == 0.0
    assert not is_layer_window_attention(None, 2, 1)
    assert [is_layer_window_attention((4, 0), 2, n) for n in (1, 2, 3, 4)] == [True, False, True, False]
    assert [is_layer_window_attention((4, 0), [1, 0], n) for n in (1, 2)] == [True, False]
    x = torch.linspace(-4, 4, 101)
    torch.testing.assert_close(openai_gelu(x), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(erf_gelu(x), F.gelu(x), atol=1e-4, rtol=1e-4)
    layer = get_linear_layer(3, 5, torch.nn.init.ones_)
    assert torch.equal(layer.weight, torch.ones(5, 3)) and torch.equal(layer.bias, torch.zeros(5))


def test_l2_norm():
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    expected = x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    out = L2Norm(hidden_size=5, config=None)(x)
    assert out.dtype == torch.bfloat16 and not list(L2Norm(5).parameters())
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_fp32_to_float16_and_float16_module_fp32_output():
    value = (torch.ones(1), [torch.ones(1, dtype=torch.int64)])
    converted = fp32_to_float16(val=value, float16_convertor=torch.Tensor.half)
    assert converted[0].dtype == torch.float16 and converted[1][0].dtype == torch.int64
    module = Float16Module(_config(bf16=True), torch.nn.Linear(2, 2))
    assert module(torch.ones(1, 2)).dtype == torch.float32
    assert module(torch.ones(1, 2), fp32_output=False).dtype == torch.bfloat16


def test_swiglu_singleton_local_shards_keys():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tensor = torch.arange(8.0).reshape(4, 2)
    sharded = ShardedTensor.from_rank_offsets("fc1.weight", tensor, (0, 1, 2), replica_id=0)
    factory = apply_swiglu_sharded_factory(sharded, (), singleton_local_shards=True)
    pieces = factory.build()
    pieces = pieces.values() if isinstance(pieces, dict) else pieces
    by_key = {piece.key: piece for piece in pieces}
    assert sorted(by_key) == ["fc1.weight_v", "fc1.weight_w"]
    assert by_key["fc1.weight_w"].global_offset == (2, 0) and torch.equal(by_key["fc1.weight_w"].data, tensor[:2])
    paired = {piece.global_offset for piece in apply_swiglu_sharded_factory(sharded, ()).build().values()}
    assert paired == {(2, 0), (6, 0)}  # rank 1 of 2: pieces 1 and 3 of 4 of the single [gate; up] tensor


def _mlp_behaviour():
    parallel_state.initialize_model_parallel(1)
    torch.manual_seed(0)
    config = _config(gated_linear_unit=True, activation_func=F.silu)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    mlp = MLP.as_mlp_submodule(submodules, config, pg_collection=None, is_mtp_layer=False, name="decoder.mlp")
    x = torch.randn(5, 1, HIDDEN)
    scale = torch.rand(5, 1)
    out, bias = mlp(x)
    scaled, no_bias = mlp(x, per_token_scale=scale, padding_mask=None)
    # fc2 is linear: scaling its input by each token's weight scales the output, and the bias is added scaled.
    torch.testing.assert_close(scaled, out * scale.unsqueeze(-1) + bias * scale.unsqueeze(-1), atol=1e-5, rtol=1e-5)
    mlp.backward_dw()  # nothing is deferred here
    with pytest.raises(TypeError):
        MLPSubmodules(linear_fc1=ColumnParallelLinear)  # fc2 is required
    tp_group = parallel_state.get_tensor_model_parallel_group()
    return no_bias is None and mlp.name == "decoder.mlp" and mlp.tp_group is tp_group


def test_mlp_per_token_scale_and_as_mlp_submodule():
    assert run_distributed(1, _mlp_behaviour) == [True]


def _cross_attention():
    parallel_state.initialize_model_parallel(1)
    torch.manual_seed(0)
    config = _config()
    submodules = CrossAttentionSubmodules(
        linear_q=ColumnParallelLinear,
        linear_kv=ColumnParallelLinear,
        core_attention=DotProductAttention,
        linear_proj=RowParallelLinear,
    )
    attention = CrossAttention(config, submodules, layer_number=1, attn_mask_type=AttnMaskType.no_mask)
    x, context = torch.randn(3, 2, HIDDEN), torch.randn(5, 2, HIDDEN)
    out, bias = attention(x, attention_mask=None, key_value_states=context)
    d = HIDDEN // HEADS
    q = (x @ attention.linear_q.weight.T + attention.linear_q.bias).view(3, 2, HEADS, d)
    kv = (context @ attention.linear_kv.weight.T + attention.linear_kv.bias).view(5, 2, HEADS, 2 * d)
    k, v = kv[..., :d], kv[..., d:]
    weights = torch.einsum("sbnd,tbnd->bnst", q, k).div(math.sqrt(d)).softmax(-1)
    context_out = torch.einsum("bnst,tbnd->sbnd", weights, v).reshape(3, 2, HIDDEN)
    torch.testing.assert_close(out, context_out @ attention.linear_proj.weight.T, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not supported yet: grouped-query cross-attention"):
        CrossAttention(_config(num_query_groups=2), submodules, layer_number=1)
    return bias is attention.linear_proj.bias


def test_cross_attention_matches_reference():
    assert run_distributed(1, _cross_attention) == [True]


def _self_attention_paths():
    parallel_state.initialize_model_parallel(1)
    torch.manual_seed(0)
    config = _config(num_query_groups=2)
    spec = get_gpt_layer_local_spec().submodules.self_attention
    attention = build_module(spec, config=config, layer_number=1)
    x = torch.randn(4, 2, HIDDEN)
    mixed, sizes = attention.get_query_key_value_tensors(x, split_qkv=False)
    q, k, v = attention.get_query_key_value_tensors(x)
    d = HIDDEN // HEADS
    assert sizes == [2 * d, d, d] and mixed.shape == (4, 2, 2, 4 * d)
    assert torch.equal(mixed[..., 2 * d : 3 * d], k)
    with pytest.raises(ValueError, match="not supported yet: gated attention output"):
        attention.get_query_key_value_tensors(x, output_gate=True)
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=d, rotary_percent=1.0)
    cos, sin = rope.get_cos_sin(4)
    by_freqs, _ = attention(x, None, rotary_pos_emb=rope(4))
    by_cos_sin, _ = attention(x, None, rotary_pos_cos=cos, rotary_pos_sin=sin)
    torch.testing.assert_close(by_freqs, by_cos_sin)
    with pytest.raises(ValueError, match="not supported yet: the fused cos/sin RoPE tensor"):
        attention(x, None, rotary_pos_cos_sin=cos)
    with pytest.raises(ValueError, match="sequence_len_offset is not used: the inference context carries"):
        attention(x, None, sequence_len_offset=2)
    from megatron.core.inference.contexts import StaticInferenceContext

    with pytest.raises(ValueError, match="inference with a KV cache supports self-attention with rotary_pos_emb"):
        attention(x, None, inference_context=StaticInferenceContext(2, 8), rotary_pos_cos=cos, rotary_pos_sin=sin)
    return True


def test_self_attention_split_qkv_and_cos_sin_rope():
    assert run_distributed(1, _self_attention_paths) == [True]


def _causal_alignments():
    parallel_state.initialize_model_parallel(1)
    config = _config()
    q, k, v = torch.randn(2, 1, HEADS, 4), torch.randn(5, 1, HEADS, 4), torch.randn(5, 1, HEADS, 4)
    top_left = DotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=0.5)
    bottom_right = DotProductAttention(config, 1, AttnMaskType.causal_bottom_right, "self", softmax_scale=0.5)
    # Top-left: query 0 sees key 0 only. Bottom-right: the two queries are the last two positions, so the last one
    # sees every key (plain attention with no mask).
    no_mask = DotProductAttention(config, 1, AttnMaskType.no_mask, "self", softmax_scale=0.5)
    torch.testing.assert_close(bottom_right(q, k, v, None)[1], no_mask(q, k, v, None)[1])
    torch.testing.assert_close(top_left(q, k, v, None)[0, 0, :4], v[0, 0, 0])
    return True


def test_causal_bottom_right_mask():
    assert run_distributed(1, _causal_alignments) == [True]


def test_transformer_layer_offset_for_a_rank():
    config = _config(
        num_layers=8,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    assert [get_transformer_layer_offset(config, vp, rank) for vp in (0, 1) for rank in (0, 1)] == [0, 2, 4, 6]


def _layers_and_block():
    parallel_state.initialize_model_parallel(1)
    config = _config(num_layers=3)
    spec = get_gpt_layer_local_spec()
    layer = build_module(spec, config=config, layer_number=2)
    unshifted = build_module(spec, config=config, layer_number=2, add_layer_offset=False, is_mtp_layer=True)
    qkv_norm, mlp_norm = layer.get_layer_norm_weights()
    assert qkv_norm is layer.input_layernorm.weight.data or torch.equal(qkv_norm, layer.input_layernorm.weight)
    assert torch.equal(layer.get_mlp_layer_norm_weights(), layer.pre_mlp_layernorm.weight)
    with layer.get_inner_quantization_context():
        pass
    # A layer with cross-attention attends to the context after self-attention.
    cross_spec = ModuleSpec(
        module=CrossAttention,
        params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=CrossAttentionSubmodules(
            linear_q=ColumnParallelLinear,
            linear_kv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
        ),
    )
    subs = spec.submodules
    with_cross = TransformerLayer(
        config,
        TransformerLayerSubmodules(
            input_layernorm=subs.input_layernorm,
            self_attention=subs.self_attention,
            self_attn_bda=subs.self_attn_bda,
            pre_cross_attn_layernorm=subs.input_layernorm,
            cross_attention=cross_spec,
            cross_attn_bda=subs.self_attn_bda,
            pre_mlp_layernorm=subs.pre_mlp_layernorm,
            mlp=subs.mlp,
            mlp_bda=subs.mlp_bda,
        ),
    )
    x, context = torch.randn(4, 2, HIDDEN), torch.randn(6, 2, HIDDEN)
    out_a, _ = with_cross(x, context=context)
    out_b, _ = with_cross(x, context=context + 1)
    assert not torch.allclose(out_a, out_b)  # the output depends on the context
    # An MLP builder that is not a spec is called with the layer's config and process groups.
    builder = functools.partial(MLP.as_mlp_submodule, submodules=subs.mlp.submodules)
    built = TransformerLayer(config, TransformerLayerSubmodules(mlp=builder))
    assert isinstance(built.mlp, MLP) and built.mlp.tp_group is parallel_state.get_tensor_model_parallel_group()
    block = TransformerBlock(config, spec)
    hidden, features = block(x, None, extract_layer_indices={0, 2})
    assert len(features) == 2 and block.has_final_layernorm_in_this_stage()
    torch.testing.assert_close(block(x, None), hidden)
    no_norm = TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[spec] * 3, layer_norm=None))
    set_model_to_sequence_parallel(block, set_to=True, exclude_modules=[block.layers[2]])
    switched = [
        block.config.sequence_parallel,
        block.layers[0].self_attention.linear_qkv.sequence_parallel,
        block.layers[2].self_attention.linear_qkv.sequence_parallel,
    ]
    set_model_to_sequence_parallel(block, set_to=False)
    assert switched == [True, True, False] and not block.layers[0].mlp.linear_fc1.sequence_parallel
    return layer.layer_number, unshifted.layer_number, no_norm.has_final_layernorm_in_this_stage()


def test_layer_numbers_norm_weights_cross_attention_and_block_features():
    assert run_distributed(1, _layers_and_block) == [(2, 2, False)]


def test_spec_helpers():
    assert get_mlp_module_spec(use_te=False).module is MLP
    assert isinstance(
        get_gpt_layer_local_spec(qk_l2_norm=True).submodules.self_attention.submodules.q_layernorm(hidden_size=4),
        L2Norm,
    )
    assert issubclass(SelfAttention, MegatronModule)


def _zeroed_embedding():
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    parallel_state.initialize_model_parallel(1)
    embedding = LanguageModelEmbedding(_config(), vocab_size=8, max_sequence_length=4, num_tokentypes=2)
    embedding.zero_parameters()
    weights = [
        embedding.word_embeddings.weight,
        embedding.position_embeddings.weight,
        embedding.tokentype_embeddings.weight,
    ]
    return all(not w.any() and w.shared for w in weights)


def test_embedding_zero_parameters():
    assert run_distributed(1, _zeroed_embedding) == [True]


def _sliding_window():
    parallel_state.initialize_model_parallel(1)
    config = _config(num_layers=4, window_size=(1, 0), window_attn_skip_freq=2)
    q, k, v = (torch.randn(5, 1, HEADS, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    windowed = DotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=0.5)
    full = DotProductAttention(config, 2, AttnMaskType.causal, "self", softmax_scale=0.5)  # every 2nd layer is full
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * 0.5
    keep = torch.ones(5, 5).tril() * torch.ones(5, 5).triu(-1)  # the key itself and the one before it
    expected = torch.einsum("bnst,tbnd->sbnd", scores.masked_fill(keep == 0, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(windowed(q, k, v, None), expected.reshape(5, 1, -1), atol=1e-5, rtol=1e-5)
    causal = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf")).softmax(-1)
    torch.testing.assert_close(
        full(q, k, v, None), torch.einsum("bnst,tbnd->sbnd", causal, v).reshape(5, 1, -1), atol=1e-5, rtol=1e-5
    )
    return windowed.window_size, full.window_size


def test_sliding_window_attention():
    assert run_distributed(1, _sliding_window) == [((1, 0), None)]
    assert torch.equal(get_sliding_window_causal_mask(3, 3, (-1, 0)), get_default_causal_mask(3))


def _packed_sequences():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams

    parallel_state.initialize_model_parallel(1)
    torch.manual_seed(0)
    attention = build_module(
        get_gpt_layer_local_spec().submodules.self_attention, config=_config(num_query_groups=2), layer_number=1
    )
    first, second = torch.randn(3, 1, HIDDEN), torch.randn(5, 1, HIDDEN)
    rope = RotaryEmbedding(kv_channels=HIDDEN // HEADS, rotary_percent=1.0)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    packed, _ = attention(
        torch.cat((first, second)), None, rotary_pos_emb=rope(5, packed_seq=True), packed_seq_params=params
    )
    separate = torch.cat([attention(x, None, rotary_pos_emb=rope(x.shape[0]))[0] for x in (first, second)])
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one row of concatenated sequences"):
        attention(torch.randn(8, 2, HIDDEN), None, packed_seq_params=params)
    with pytest.raises(ValueError, match="not supported yet: packed_seq_params with qkv_format='sbhd'"):
        attention(torch.randn(8, 1, HIDDEN), None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    return packed.shape


def test_packed_sequences_attend_within_themselves():
    assert run_distributed(1, _packed_sequences) == [torch.Size([8, 1, HIDDEN])]


def _packed_gpt():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams

    parallel_state.initialize_model_parallel(1)
    torch.manual_seed(0)
    model = GPTModel(
        _config(), get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8, position_embedding_type="rope"
    ).eval()
    tokens = torch.randint(0, 32, (1, 8))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    packed = model(tokens, None, None, packed_seq_params=params)
    separate = torch.cat([model(tokens[:, :3], None, None), model(tokens[:, 3:], None, None)], dim=1)
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)
    return True


def test_gpt_model_on_packed_sequences():
    assert run_distributed(1, _packed_gpt) == [True]


def test_set_symmetric_ar():
    module = MegatronModule(_config())
    module.inner = torch.nn.Linear(2, 2)
    module.inner.symmetric_ar_type = None
    module.set_symmetric_ar("two_shot")
    assert module.inner.symmetric_ar_type == "two_shot"
    with pytest.raises(ValueError, match="set_to='three_shot' is not one of"):
        module.set_symmetric_ar("three_shot")


class _CachesWeights(torch.nn.Module):
    is_first_microbatch = False


@pytest.mark.parametrize("quantization", [{}, {"quant_recipe": object()}, {"fp8": "hybrid"}])
def test_set_is_first_microbatch_only_with_a_quantized_mode(quantization):
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    for name, value in quantization.items():
        setattr(config, name, value)
    module = MegatronModule(config)
    module.child = _CachesWeights()
    module.set_is_first_microbatch()
    assert module.child.is_first_microbatch is bool(quantization)
