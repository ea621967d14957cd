"""Theoretical memory against hand-computed values and the published expressions (Korthikanti et al. 2022 Table 2
and Sec. 4.3; the distributed optimizer's 18 vs 6 + 12/d bytes per parameter), and the report tool."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron.training.theoretical_memory_usage import (
    NUM_BYTES_IN_MEGABYTE,
    bytes_per_parameter,
    compute_activation_memory,
    compute_activation_memory_without_sp,
    compute_weight_and_optimizer_memory,
    count_parameters,
    report_theoretical_memory,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


def gpt3_175b(**overrides):
    """GPT-3 175B as trained in Korthikanti et al. (t=8, p=8), with SP and selective recomputation."""
    args = dict(
        num_layers=96,
        hidden_size=12288,
        ffn_hidden_size=4 * 12288,
        num_attention_heads=96,
        kv_channels=128,
        group_query_attention=False,
        num_query_groups=1,
        seq_length=2048,
        swiglu=False,
        padded_vocab_size=51200,
        normalization="LayerNorm",
        untie_embeddings_and_output_weights=False,
        tensor_model_parallel_size=8,
        pipeline_model_parallel_size=8,
        virtual_pipeline_model_parallel_size=None,
        world_size=64,
        data_parallel_size=1,
        use_distributed_optimizer=False,
        micro_batch_size=1,
        sequence_parallel=True,
        recompute_granularity="selective",
    )
    args.update(overrides)
    return SimpleNamespace(**args)


def llama3_8b(**overrides):
    """Llama-3-8B at TP2 x PP2 x DP4 with the distributed optimizer."""
    args = dict(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        kv_channels=128,
        group_query_attention=True,
        num_query_groups=8,
        seq_length=8192,
        swiglu=True,
        padded_vocab_size=128256,
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=None,
        world_size=16,
        data_parallel_size=4,
        use_distributed_optimizer=True,
        micro_batch_size=1,
        sequence_parallel=True,
        recompute_granularity="selective",
        add_bias_linear=False,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


def test_bytes_per_parameter_follow_the_distributed_optimizer_table():
    """bf16 params + fp32 grads + fp32 main params and Adam m, v: 18 bytes, or 6 + 12/d sharded."""
    assert bytes_per_parameter(False, 8) == 18
    assert [bytes_per_parameter(True, d) for d in (1, 2, 4, 8)] == [18, 12, 9, 7.5]


def test_gpt3_parameters_against_narayanan_eq2():
    """Eq. 2, P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), counts linear biases (9h per layer) and learned
    positions (s h); the estimator counts neither, and adds the final norm (2h)."""
    l, h, v, s = 96, 12288, 51200, 2048
    counts = count_parameters(gpt3_175b())
    ours = counts.transformer_block + counts.embedding_layers
    eq2 = 12 * l * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    assert eq2 - ours == pytest.approx(9 * l * h + s * h - 2 * h, rel=1e-9)
    assert ours == 174_580_064_256


def test_llama3_8b_has_its_published_parameter_count():
    counts = count_parameters(llama3_8b())
    assert counts.transformer_block + counts.embedding_layers == 8_030_261_248


def test_weight_and_optimizer_bytes_by_hand():
    """Most loaded rank (stage 0, one TP half): (6,979,321,856 TP-split block weights / 2 stages + 525,336,576
    embedding) / 2 + (32 x 8192 norms + 4096 final norm) / 2 = 2,007,631,872 parameters."""
    shard = 2_007_631_872
    assert compute_weight_and_optimizer_memory(llama3_8b()) == shard * (6 + 12 / 4)
    assert compute_weight_and_optimizer_memory(llama3_8b(use_distributed_optimizer=False)) == shard * 18


def test_untied_output_layer_counts_on_a_single_stage():
    one_stage = llama3_8b(pipeline_model_parallel_size=1, world_size=8, use_distributed_optimizer=False)
    tied = llama3_8b(
        pipeline_model_parallel_size=1,
        world_size=8,
        use_distributed_optimizer=False,
        untie_embeddings_and_output_weights=False,
    )
    output_layer_shard = 4096 * 128256 / 2
    assert compute_weight_and_optimizer_memory(one_stage) - compute_weight_and_optimizer_memory(tied) == (
        output_layer_shard * 18
    )


def test_expert_weights_use_the_expert_data_parallel_size():
    """8 ranks, TP2 (DP 4), EP4 x ETP1 (expert DP 2), one stage: 4 experts of 2 x h x 512, 2 MoE layers."""
    h = 1024
    args = llama3_8b(
        num_layers=2,
        hidden_size=h,
        ffn_hidden_size=4096,
        num_attention_heads=8,
        num_query_groups=8,
        group_query_attention=False,
        swiglu=False,
        padded_vocab_size=1024,
        untie_embeddings_and_output_weights=False,
        pipeline_model_parallel_size=1,
        world_size=8,
        num_experts=4,
        moe_ffn_hidden_size=512,
        moe_router_topk=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
        add_bias_linear=True,
    )
    attention = 2 * h * 1024 * 2
    tp_split = (2 * attention + h * 1024) / 2
    replicated = 2 * (2 * h + h * 4 + 4) + h  # RMSNorms, router weights and biases, final norm
    experts = 2 * (2 * h * 512 * 4) / 4
    expected = (tp_split + replicated) * (6 + 12 / 4) + experts * (6 + 12 / 2)
    assert compute_weight_and_optimizer_memory(args) == pytest.approx(expected, rel=1e-12)
    counts = count_parameters(args)
    assert counts.transformer_block - counts.active_transformer_block == 2 * 2 * (2 * h * 512)


def test_activation_memory_with_sp_and_selective_recompute_is_tables_34_sbh_over_t():
    """Eq. 6, 34 s b h L / t, plus Sec. 4.3's p s b h / t (embedding dropout) and Megatron's 8 s b p / t token ids;
    with one stage, also 4 s b h (1 + V/h) / t for the output layer and loss."""
    s, b, h, l, t, v = 2048, 1, 12288, 96, 8, 51200
    for p in (8, 1):
        args = gpt3_175b(pipeline_model_parallel_size=p, micro_batch_size=b)
        expected = (34 * s * b * h * l + s * b * h * p + 8 * s * b * p) / t
        if p == 1:
            expected += 4 * s * b * h * (1 + v / h) / t
        assert compute_activation_memory(args, num_microbatches=None) == pytest.approx(expected, rel=1e-12)


def test_swiglu_width_enters_the_per_layer_term():
    args = llama3_8b(pipeline_model_parallel_size=1, num_layers=1)
    per_layer = 8192 * 4096 * (18 + 4 * 14336 / 4096) / 2
    extras = (8192 * 4096 + 8 * 8192 + 4 * 8192 * 4096 * (1 + 128256 / 4096)) / 2
    assert compute_activation_memory(args, None) == pytest.approx(per_layer + extras, rel=1e-12)


def test_pipeline_schedule_factors():
    base = compute_activation_memory(gpt3_175b(), num_microbatches=None)
    interleaved = compute_activation_memory(gpt3_175b(virtual_pipeline_model_parallel_size=2), None)
    assert interleaved == pytest.approx(base * (1 + 7 / 16), rel=1e-12)
    # 1F1B with 2 micro-batches on 8 stages never fills the pipeline; 16 micro-batches do.
    assert compute_activation_memory(gpt3_175b(), num_microbatches=2) == pytest.approx(base * 2 / 8, rel=1e-12)
    assert compute_activation_memory(gpt3_175b(), num_microbatches=16) == pytest.approx(base, rel=1e-12)


def test_activation_memory_without_sp_is_tables_tp_selective_row_plus_5_percent():
    """Table 2's "tensor parallel + selective recompute": s b h (10 + 24/t) per layer."""
    s, b, h, l, t, v = 2048, 2, 12288, 96, 8, 51200
    for p in (8, 1):
        args = gpt3_175b(pipeline_model_parallel_size=p, micro_batch_size=b, sequence_parallel=False)
        expected = s * b * h * (10 + 24 / t) * l + s * b * h * p + 8 * s * b * p
        if p == 1:
            expected += 2 * (s * b * v / t + s * b * h)
        assert compute_activation_memory_without_sp(args, None) == pytest.approx(1.05 * expected, rel=1e-12)


@pytest.mark.parametrize(
    "sequence_parallel, granularity, uses_sp_formula",
    [
        (True, "selective", True),
        (False, "selective", False),
        (True, None, False),
        (True, "full", False),
    ],
)
def test_report_picks_the_formula_and_prints_megatrons_line(capsys, sequence_parallel, granularity, uses_sp_formula):
    args = llama3_8b(sequence_parallel=sequence_parallel, recompute_granularity=granularity)
    weights, activation, total = report_theoretical_memory(args, num_microbatches=8)
    activation_function = compute_activation_memory if uses_sp_formula else compute_activation_memory_without_sp
    assert activation == activation_function(args, 8) / NUM_BYTES_IN_MEGABYTE
    assert weights == pytest.approx(17231.64, abs=0.005) and total == weights + activation
    assert capsys.readouterr().out == (
        f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
        f"activation={activation:.2f} MB, total={total:.2f} MB\n\n"
    )


def test_verbose_report_lists_parameter_counts(capsys):
    report_theoretical_memory(llama3_8b(), verbose=True)
    out = capsys.readouterr().out
    assert "Total number of parameters in billions: 8.03" in out
    assert "Number of parameters in most loaded shard in billions: 2.0076" in out
    assert "Number of in-flight microbatches: 2" in out


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"data_parallel_size": None}, "args.data_parallel_size is not set; run validate_args"),
        ({"padded_vocab_size": None}, "args.padded_vocab_size is not set; build the tokenizer"),
        (
            {"world_size": 12, "num_experts": 2, "moe_ffn_hidden_size": 64, "expert_model_parallel_size": 4},
            r"world size \(12\) is not divisible by expert_tensor_parallel_size \(2\) x expert_model_parallel_size "
            r"\(4\) x pipeline_model_parallel_size \(2\)",
        ),
    ],
)
def test_missing_or_inconsistent_args_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        compute_weight_and_optimizer_memory(llama3_8b(**overrides))


# ---- tools/report_theoretical_memory.py ----

LLAMA3_8B_FLAGS = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --seq-length 8192 --position-embedding-type rope --swiglu --normalization RMSNorm "
    "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --world-size 16 --use-distributed-optimizer "
    "--sequence-parallel --recompute-activations"
).split()
# NullTokenizer adds an end-of-document id: 128255 + 1 = Llama-3's 128256, a multiple of 128 x TP already.
NULL_TOKENIZER_FLAGS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128255"]


def load_tool():
    spec = importlib.util.spec_from_file_location(
        "report_theoretical_memory", REPO_ROOT / "tools" / "report_theoretical_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tool_prints_the_report_for_megatron_flags(capsys):
    load_tool().main(LLAMA3_8B_FLAGS + NULL_TOKENIZER_FLAGS + ["--global-batch-size", "64"])
    out = capsys.readouterr().out
    activation = compute_activation_memory(llama3_8b(), num_microbatches=16) / NUM_BYTES_IN_MEGABYTE
    assert f"Theoretical memory footprints: weight and optimizer=17231.64 MB, activation={activation:.2f} MB" in out
    assert "Parallel layout" not in out


def test_tool_takes_the_world_size_flag_over_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = load_tool().resolve_args(LLAMA3_8B_FLAGS + NULL_TOKENIZER_FLAGS)
    assert (args.world_size, args.data_parallel_size, args.padded_vocab_size) == (16, 4, 128256)
    without_flag = [flag for flag in LLAMA3_8B_FLAGS if flag not in ("--world-size", "16")]
    assert load_tool().resolve_args(without_flag + NULL_TOKENIZER_FLAGS).data_parallel_size == 1


def test_tool_shows_the_layout_when_asked(capsys):
    load_tool().main(LLAMA3_8B_FLAGS + NULL_TOKENIZER_FLAGS + ["--show-layout"])
    out = capsys.readouterr().out
    assert "Parallel layout: 16 ranks = TP 2 x CP 1 x DP 4 x PP 2" in out
    assert "parameters: 4,015,128,576 in the stage, 2,007,629,824 per tensor-parallel rank" in out
    assert out.index("Parallel layout") < out.index("Theoretical memory footprints")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--world-size", "6"], r"world size \(6\) is not divisible by --tensor-model-parallel-size \(2\)"),
        (["--global-batch-size", "6"], r"--global-batch-size \(6\) must be a multiple of --micro-batch-size"),
        (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    ],
)
def test_tool_rejects_inconsistent_flags(extra, message):
    with pytest.raises(ValueError, match=message):
        load_tool().main(LLAMA3_8B_FLAGS + NULL_TOKENIZER_FLAGS + extra)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_context_parallelism_divides_activations_by_cp(sequence_parallel):
    """Each CP rank holds s/cp of every sequence: the same estimate as a cp-times shorter sequence."""
    recompute = "selective" if sequence_parallel else None
    activation = compute_activation_memory if sequence_parallel else compute_activation_memory_without_sp
    at_cp4 = activation(
        llama3_8b(context_parallel_size=4, sequence_parallel=sequence_parallel, recompute_granularity=recompute),
        num_microbatches=8,
    )
    at_cp1 = activation(
        llama3_8b(context_parallel_size=1, sequence_parallel=sequence_parallel, recompute_granularity=recompute),
        num_microbatches=8,
    )
    shorter = activation(
        llama3_8b(seq_length=8192 // 4, sequence_parallel=sequence_parallel, recompute_granularity=recompute),
        num_microbatches=8,
    )
    assert at_cp4 == pytest.approx(shorter)
    assert at_cp4 == pytest.approx(at_cp1 / 4)
