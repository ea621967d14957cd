"""The layout report: rank groups against the mixed-radix rule, layers per stage against transformer_block's own
functions, parameter counts against built models, the text, and every configuration error."""

from itertools import product
from types import SimpleNamespace

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import get_num_layers_to_build, get_transformer_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.layout_report import (
    describe_parallel_layout,
    describe_parallel_layout_for_args,
    layers_per_virtual_stage,
    parallel_layout,
    stage_parameter_counts,
)
from tests.unit_tests.test_utilities import run_distributed


def groups_by_mixed_radix(sizes, order, varying):
    """Groups of ranks that differ only in the ``varying`` coordinates, where a rank's coordinates are the digits
    of its number in the mixed radix ``order`` (first token least significant). Each group is listed by
    increasing rank; groups are compared as a set."""
    names = order.split("-")
    groups = {}
    for rank in range(int(torch.tensor([sizes[name] for name in names]).prod())):
        digits, rest = {}, rank
        for name in names:
            rest, digits[name] = divmod(rest, sizes[name])
        fixed = tuple(digits[name] for name in names if name not in varying)
        groups.setdefault(fixed, []).append(rank)
    return sorted(sorted(group) for group in groups.values())


@pytest.mark.parametrize(
    "world, tp, pp, cp, ep, etp, order",
    [
        (16, 2, 2, 2, 1, None, "tp-cp-ep-dp-pp"),
        (8, 2, 2, 1, 1, None, "tp-cp-ep-pp-dp"),
        (16, 2, 2, 1, 2, 1, "tp-cp-ep-dp-pp"),
        (24, 3, 2, 1, 1, None, "tp-cp-ep-dp-pp"),
    ],
)
def test_groups_follow_the_mixed_radix_rule(world, tp, pp, cp, ep, etp, order):
    layout = parallel_layout(world, tp, pp, cp, ep, etp, order, num_layers=4)
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": world // (tp * pp * cp), "pp": pp}
    etp = tp if etp is None else etp
    expert = {"tp": etp, "cp": 1, "ep": ep, "dp": world // (etp * ep * pp), "pp": pp}
    expected = {
        "tensor-parallel": groups_by_mixed_radix(dense, order, {"tp"}),
        "pipeline-parallel": groups_by_mixed_radix(dense, order, {"pp"}),
        "data-parallel": groups_by_mixed_radix(dense, order, {"dp"}),
        "context-parallel": groups_by_mixed_radix(dense, order, {"cp"}),
        "data-parallel with context": groups_by_mixed_radix(dense, order, {"dp", "cp"}),
        "expert-model-parallel": groups_by_mixed_radix(expert, order, {"ep"}),
        "expert-tensor-parallel": groups_by_mixed_radix(expert, order, {"tp"}),
        "expert-data-parallel": groups_by_mixed_radix(expert, order, {"dp"}),
    }
    for kind, groups in expected.items():
        assert sorted(sorted(group) for group in layout.groups[kind]) == groups, kind
    # Every rank is in exactly one group of each kind, and a pipeline lists its stages in order.
    for kind, groups in layout.groups.items():
        if kind != "embedding":
            assert sorted(rank for group in groups for rank in group) == list(range(world)), kind
    assert layout.groups["embedding"] == [[group[0], group[-1]] for group in layout.groups["pipeline-parallel"]]


def test_default_order_matches_the_documented_formula():
    """parallel_state: global_rank = tp_rank + cp_rank*tp + dp_rank*tp*cp + pp_rank*tp*cp*dp."""
    tp, cp, dp, pp = 2, 2, 3, 2
    layout = parallel_layout(tp * cp * dp * pp, tp, pp, cp, 1, None, "tp-cp-ep-dp-pp", num_layers=2)
    for t, c, d, p in product(range(tp), range(cp), range(dp), range(pp)):
        rank = t + c * tp + d * tp * cp + p * tp * cp * dp
        assert layout.groups["tensor-parallel"][(c + cp * d + cp * dp * p)][t] == rank
        assert rank in layout.stage_ranks(p)


SPLITS = [
    dict(num_layers=8, pp=1),
    dict(num_layers=8, pp=2),
    dict(num_layers=8, pp=2, vpp=2),
    dict(num_layers=16, pp=4, vpp=2),
    dict(num_layers=10, pp=4, first_stage_layers=1, last_stage_layers=3),
    dict(num_layers=7, pp=4, first_stage_layers=1),
    dict(num_layers=10, pp=3, vpp=2, last_stage_layers=2),
    dict(num_layers=14, pp=4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
    dict(
        num_layers=6, pp=2, vpp=2, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True
    ),
]


@pytest.mark.parametrize("split", SPLITS)
def test_layers_per_stage_match_transformer_block(split):
    """The pure split agrees with get_num_layers_to_build / get_transformer_layer_offset at every pipeline rank
    (given to them through parallel_state's rank override, as Megatron's tests do)."""
    pp, vpp = split["pp"], split.get("vpp")
    config = TransformerConfig(
        num_layers=split["num_layers"],
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=split.get("first_stage_layers"),
        num_layers_in_last_pipeline_stage=split.get("last_stage_layers"),
        account_for_embedding_in_pipeline_split=split.get("account_for_embedding_in_pipeline_split", False),
        account_for_loss_in_pipeline_split=split.get("account_for_loss_in_pipeline_split", False),
    )
    layout = parallel_layout(world_size=pp, tp=1, cp=1, ep=1, etp=None, order="tp-cp-ep-dp-pp", **split)
    try:
        for chunk in layout.chunks:
            parallel_state.set_pipeline_model_parallel_rank(chunk.pipeline_rank)
            vp_stage = chunk.virtual_rank if vpp else None
            assert chunk.num_layers == get_num_layers_to_build(config, vp_stage=vp_stage)
            assert chunk.first_layer == get_transformer_layer_offset(config, vp_stage=vp_stage)
    finally:
        parallel_state.set_pipeline_model_parallel_rank(None)
    assert sum(chunk.num_layers for chunk in layout.chunks) == split["num_layers"]
    assert [c.has_embedding for c in layout.chunks].count(True) == [c.has_output for c in layout.chunks].count(True)


def test_interleaved_chunks_take_consecutive_slices_in_pipeline_order():
    assert layers_per_virtual_stage(16, 4, vpp=2) == [2] * 8
    chunks = parallel_layout(4, 1, 4, 1, 1, None, "tp-cp-ep-dp-pp", 16, vpp=2).chunks
    assert [(c.pipeline_rank, c.virtual_rank, list(c.layers)) for c in chunks[:2]] == [(0, 0, [0, 1]), (0, 1, [8, 9])]
    assert chunks[0].has_embedding and chunks[-1].has_output and (chunks[-1].pipeline_rank, chunks[-1].virtual_rank)
    assert (chunks[-1].pipeline_rank, chunks[-1].virtual_rank) == (3, 1)


def test_a_pipeline_layout_places_the_layers():
    layout = "E|tt|t|tL"
    chunks = parallel_layout(2, 1, 2, 1, 1, None, "tp-cp-ep-dp-pp", 4, vpp=2, pipeline_model_parallel_layout=layout)
    placed = [(c.pipeline_rank, c.virtual_rank, list(c.layers)) for c in chunks.chunks]
    assert placed == [(0, 0, []), (0, 1, [2]), (1, 0, [0, 1]), (1, 1, [3])]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(world_size=6, tp=4),
            r"world size \(6\) is not divisible by tensor_model_parallel_size \(4\) x .* = 8; launch",
        ),
        (
            dict(world_size=8, ep=8, etp=2),
            r"world size \(8\) is not divisible by expert_tensor_parallel_size \(2\) x .* = 32; launch",
        ),
        (dict(tp=0), "tensor_model_parallel_size must be a positive integer, got 0"),
        (dict(pp=1, vpp=2), "virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"),
        (dict(order="tp-xx-dp-pp"), "unknown token 'xx' in order 'tp-xx-dp-pp'"),
        (dict(world_size=16, ep=4, etp=1, order="tp-cp-ep-pp-dp"), "order 'tp-cp-ep-pp-dp' does not end with 'pp'"),
        (
            dict(num_layers=7),
            r"--num-layers \(7\) is not divisible by --pipeline-model-parallel-size \(2\); change --num-layers",
        ),
        (
            dict(num_layers=8, account_for_embedding_in_pipeline_split=True),
            r"--num-layers \(8\) \+ embedding/loss \(1\) = 9 is not divisible by --pipeline-model-parallel-size \(2\)",
        ),
        (
            dict(num_layers=6, vpp=2),
            r"pipeline stage 0 has 3 layers, not divisible by --num-virtual-stages-per-pipeline-rank \(2\)",
        ),
        (dict(first_stage_layers=9), r"--num-layers \(8\) does not match --decoder-first-pipeline-num-layers \(9\)"),
        (dict(first_stage_layers=0), "--decoder-first-pipeline-num-layers must be a positive integer, got 0"),
        (
            dict(pp=4, world_size=4, num_layers=8, first_stage_layers=1),
            "the 7 layers left after --decoder-first/last-pipeline-num-layers do not divide evenly over the other 3 "
            "pipeline stages",
        ),
        (
            dict(pp=1, world_size=1, last_stage_layers=2),
            "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1; unset them",
        ),
        (
            dict(first_stage_layers=2, account_for_loss_in_pipeline_split=True),
            "cannot be combined with --account-for-embedding-in-pipeline-split",
        ),
    ],
)
def test_bad_layouts_are_rejected_with_the_fix(kwargs, message):
    arguments = dict(world_size=4, tp=1, pp=2, cp=1, ep=1, etp=None, order="tp-cp-ep-dp-pp", num_layers=8)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        parallel_layout(**arguments)


def model_args(variant: str, tp: int):
    """Megatron-LM args of two small GPTs: GPT-2 style (LayerNorm, biases, learned positions, untied output) and
    Llama style (RMSNorm, no biases, GQA, SwiGLU, RoPE, tied output, q/k norms)."""
    common = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        kv_channels=8,
        padded_vocab_size=64 * tp,
        max_position_embeddings=16,
        num_experts=None,
    )
    if variant == "gpt2":
        return SimpleNamespace(
            **common,
            ffn_hidden_size=64,
            group_query_attention=False,
            num_query_groups=1,
            swiglu=False,
            normalization="LayerNorm",
            add_bias_linear=True,
            add_qkv_bias=False,
            qk_layernorm=False,
            position_embedding_type="learned_absolute",
            untie_embeddings_and_output_weights=True,
        )
    return SimpleNamespace(
        **common,
        ffn_hidden_size=48,
        group_query_attention=True,
        num_query_groups=2,
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        add_qkv_bias=True,
        qk_layernorm=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=False,
    )


def _parameters_on_this_rank(variant: str, tp: int, pp: int, vpp):
    """Build this rank's model chunks from the same args and count their parameters."""
    import torch.nn.functional as F

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    args = model_args(variant, tp)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    total = 0
    for vp_stage in range(vpp or 1):
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            vp_stage=vp_stage if vpp else None,
        )
        total += sum(param.numel() for param in model.parameters())
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    parallel_state.destroy_model_parallel()
    return pipeline_rank, total


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("tp, pp, vpp", [(1, 1, None), (2, 2, None), (1, 2, 2)])
def test_parameter_counts_match_the_built_model(variant, tp, pp, vpp):
    layout = parallel_layout(tp * pp, tp, pp, 1, 1, None, "tp-cp-ep-dp-pp", num_layers=4, vpp=vpp)
    expected = stage_parameter_counts(model_args(variant, tp), layout)
    built = run_distributed(tp * pp, _parameters_on_this_rank, variant, tp, pp, vpp)
    for pipeline_rank, count in built:
        assert count == expected[pipeline_rank][1]
    # A stage's total is its TP ranks' parameters with the replicated ones (norms, row-parallel biases) once.
    if tp == 1:
        assert [total for total, _ in expected] == [per_rank for _, per_rank in expected]


def _moe_args(variant: str, tp: int):
    """model_args with 4 experts (top-2) in every other layer (--moe-layer-freq 2), the GPT-2 style one also with a
    gated shared expert."""
    args = model_args(variant, tp)
    args.num_experts, args.moe_layer_freq, args.moe_router_topk, args.moe_ffn_hidden_size = 4, 2, 2, 24
    args.moe_shared_expert_intermediate_size = 16 if variant == "gpt2" else None
    args.moe_shared_expert_gate = variant == "gpt2"
    return args


def _moe_parameters_on_this_rank(variant: str, tp: int, ep: int, pp: int):
    """Build this rank's MoE model stage (from the decoder block spec pretrain_gpt uses) and count its parameters."""
    import torch.nn.functional as F

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    args = _moe_args(variant, tp)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        num_moe_experts=args.num_experts,
        moe_layer_freq=args.moe_layer_freq,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_token_dispatcher_type="alltoall",
    )
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    total = sum(param.numel() for param in model.parameters())
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    parallel_state.destroy_model_parallel()
    return pipeline_rank, total


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("tp, ep, pp", [(1, 2, 2), (2, 2, 1)])
def test_moe_parameter_counts_match_the_built_model(variant, tp, ep, pp):
    world = 4  # TP2 x EP2 (ETP = TP: expert-DP 1, DP 2) or EP2 x PP2 (DP 2, expert-DP 1)
    layout = parallel_layout(world, tp, pp, 1, ep, None, "tp-cp-ep-dp-pp", num_layers=4)
    expected = stage_parameter_counts(_moe_args(variant, tp), layout)
    for pipeline_rank, count in run_distributed(world, _moe_parameters_on_this_rank, variant, tp, ep, pp):
        assert count == expected[pipeline_rank][1], f"pipeline rank {pipeline_rank}"
    text = describe_parallel_layout(world, tp, pp, 1, ep, None, "tp-cp-ep-dp-pp", 4, model_args=_moe_args(variant, tp))
    assert "per rank (TP share + 1/EP of the experts)" in text


def test_report_text():
    text = describe_parallel_layout(32, 2, 2, 1, 1, None, "tp-cp-ep-dp-pp", 8, vpp=2, model_args=model_args("llama", 2))
    lines = text.splitlines()
    assert lines[0] == "Parallel layout: 32 ranks = TP 2 x CP 1 x DP 8 x PP 2, order tp-cp-ep-dp-pp"
    assert lines[1] == "Expert layout: ETP 2 x EP 1 x expert-DP 8 x PP 2"
    tensor_line = next(line for line in lines if line.strip().startswith("tensor-parallel"))
    assert tensor_line.endswith("[0, 1] [2, 3] [4, 5] [6, 7] [8, 9] [10, 11] [12, 13] [14, 15] ... (8 more)")
    start = lines.index("Pipeline stages (8 layers, 2 virtual stages per rank; layer i is decoder.layers.<i>):")
    assert lines[start + 1] == "  stage 0 on ranks [" + ", ".join(str(rank) for rank in range(16)) + "]"
    assert lines[start + 2 : start + 4] == ["    chunk 0: layers 0-1 + embedding", "    chunk 1: layers 4-5"]
    assert lines[start + 4].startswith("    parameters: ") and lines[start + 4].endswith(" per tensor-parallel rank")
    assert lines[start + 7] == "    chunk 1: layers 6-7 + final norm + output layer"


def test_report_for_megatron_args_uses_their_names():
    args = model_args("gpt2", 1)
    args.__dict__.update(
        world_size=4,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2,
        use_tp_pp_dp_mapping=True,
        virtual_pipeline_model_parallel_size=None,
        decoder_first_pipeline_num_layers=1,
        decoder_last_pipeline_num_layers=3,
    )
    text = describe_parallel_layout_for_args(args)
    assert "order tp-cp-ep-pp-dp" in text
    assert "    layer 0 + embedding" in text and "    layers 1-3 + final norm + output layer" in text
    assert "  pipeline-parallel           [0, 1] [2, 3]" in text


def test_report_says_what_each_context_parallel_rank_holds():
    args = model_args("gpt2", 1)
    args.__dict__.update(seq_length=64, cp_comm_type=["a2a"])
    text = describe_parallel_layout(8, 1, 2, 2, 1, None, "tp-cp-ep-dp-pp", 4, model_args=args)
    assert "  context-parallel            [0, 1] [2, 3] [4, 5] [6, 7]" in text
    assert (
        "Context parallelism: every sequence is cut into 4 chunks and CP rank r holds chunks r and 3-r (32 of 64 "
        "tokens: load-balanced for causal attention); attention communicates by a2a"
    ) in text.splitlines()
    assert "Context parallelism" not in describe_parallel_layout(8, 1, 2, 1, 1, None, "tp-cp-ep-dp-pp", 4)
