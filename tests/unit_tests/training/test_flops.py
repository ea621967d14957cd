"""FLOPs per iteration against the papers' closed forms, hand-computed values and a FLOP counter; throughput, MFU,
the device peak table and the CPU matmul peak."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron.training import flops
from megatron.training.flops import (
    measured_cpu_matmul_peak_flops,
    num_floating_point_operations,
    peak_flops_for_device_name,
    throughput_and_mfu,
)
from tests.unit_tests.test_utilities import run_distributed


def gpt_args(**overrides):
    """Megatron-LM args of a GPT-3-style model (MHA, GELU, f = 4h), as validate_args leaves them."""
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
    )
    args.update(overrides)
    return SimpleNamespace(**args)


def llama3_8b_args(**overrides):
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
    )
    args.update(overrides)
    return SimpleNamespace(**args)


def model_flops_eq7(batch, seq, layers, hidden, vocab):
    """Korthikanti et al. 2022, Eq. 7 (no causal halving): 72 B s L h^2 (1 + s/(6h) + V/(12 h L))."""
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * hidden * layers))


def test_gpt3_175b_without_causal_halving_is_the_papers_model_flops():
    args = gpt_args()
    expected = model_flops_eq7(1536, 2048, 96, 12288, 51200)
    assert num_floating_point_operations(args, 1536, causal_attention=False) == pytest.approx(expected, rel=1e-12)


def test_papers_worked_example_gpt2_small():
    """papers.md: B=8, s=1024, L=12, h=768, V=50304 gives 7.0013e12 model FLOPs per iteration."""
    args = gpt_args(
        num_layers=12,
        hidden_size=768,
        ffn_hidden_size=3072,
        num_attention_heads=12,
        kv_channels=64,
        seq_length=1024,
        padded_vocab_size=50304,
    )
    assert num_floating_point_operations(args, 8, causal_attention=False) == pytest.approx(7.0013e12, rel=1e-4)


def test_causal_convention_halves_only_the_attention_core():
    args = gpt_args()
    batch, seq, layers, query_size = 1536, 2048, 96, 96 * 128
    # Full scores + attention x V: 2 matmuls of 2 q s^2 FLOPs each, x3 for fwd+bwd; causal keeps half.
    full_core = 3 * 2 * (2 * query_size * seq * seq) * layers * batch
    difference = num_floating_point_operations(args, batch, False) - num_floating_point_operations(args, batch)
    assert difference == pytest.approx(full_core / 2, rel=1e-12)


def test_llama3_8b_per_token_by_hand():
    """GQA (8 KV heads), SwiGLU, causal-halved attention at s = 8192, per token:
    QKV+proj 6*(4096*(4096 + 2*1024) + 4096*4096) = 251,658,240; core 6*4096*8192 = 201,326,592;
    MLP 6*3*4096*14336 = 1,056,964,608; x32 layers = 48,318,382,080; logits 6*4096*128256 = 3,152,019,456."""
    per_token = 48_318_382_080 + 3_152_019_456
    assert num_floating_point_operations(llama3_8b_args(), 1) == per_token * 8192


def test_matches_megatron_closed_form_with_gqa_swiglu_and_causal_mask():
    """Megatron-LM's expression: 12 B s L h^2 ((1 + g/n + s/(2h)) q/h + 3/2 f/h + V/(2 L h))."""
    args = llama3_8b_args(seq_length=4096, kv_channels=160)
    b, s, layers, h, n, g, q = 16, 4096, 32, 4096, 32, 8, 160 * 32
    expected = (
        12 * b * s * layers * h**2 * ((1 + g / n + s / (2 * h)) * q / h + 1.5 * 14336 / h + 128256 / (2 * layers * h))
    )
    assert num_floating_point_operations(args, b) == pytest.approx(expected, rel=1e-12)


def test_moe_layers_count_top_k_routed_and_shared_experts():
    dense = llama3_8b_args()
    mlp_per_layer_per_token = 6 * 2 * 4096 * 1.5  # per unit of MLP width
    base = num_floating_point_operations(dense, 1) - 32 * 14336 * mlp_per_layer_per_token * 8192
    moe = llama3_8b_args(
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=1024,
        moe_shared_expert_intermediate_size=512,
        moe_layer_freq=2,
    )
    # Layers 0, 2, ..., 30 are MoE (2 x 1024 routed + 512 shared), the other 16 dense (14336).
    width = 16 * (2 * 1024 + 512) + 16 * 14336
    assert num_floating_point_operations(moe, 1) == pytest.approx(base + width * mlp_per_layer_per_token * 8192)
    pattern = [1, 0] * 16
    assert num_floating_point_operations(llama3_8b_args(**{**vars(moe), "moe_layer_freq": pattern}), 1) == (
        num_floating_point_operations(moe, 1)
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"kv_channels": None}, "args.kv_channels is not set; run validate_args or pass --kv-channels"),
        ({"padded_vocab_size": None}, "args.padded_vocab_size is not set; build the tokenizer"),
        ({"num_query_groups": None}, "args.num_query_groups is not set; pass --num-query-groups"),
        ({"num_experts": 8, "moe_ffn_hidden_size": None}, "args.moe_ffn_hidden_size is not set"),
        (
            {"num_experts": 8, "moe_ffn_hidden_size": 64, "moe_layer_freq": [1, 0]},
            r"--moe-layer-freq pattern \[1, 0\] must have one 0/1 entry per layer \(32 layers\)",
        ),
        (
            {"num_experts": 8, "moe_ffn_hidden_size": 64, "moe_layer_freq": 0},
            "--moe-layer-freq must be a positive integer or a list of 0/1, got 0",
        ),
    ],
)
def test_missing_or_bad_args_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        num_floating_point_operations(llama3_8b_args(**overrides), 1)


def _count_gpt_flops(swiglu: bool):
    """A tiny GQA GPT's fwd+bwd under torch's FLOP counter (matmuls and attention, full s^2 scores)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    activation = dict(gated_linear_unit=True, activation_func=F.silu) if swiglu else {}
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=96,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        **activation,
    )
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=32, position_embedding_type="rope"
    )
    tokens = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(3, 32)
    # The math backend runs attention as plain matmuls, which the counter sees (it has no rule for the fused CPU
    # kernel); it computes the full s x s scores, as the non-halved convention counts.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, positions, None, labels=tokens).sum().backward()
    parallel_state.destroy_model_parallel()
    return counter.get_total_flops()


@pytest.mark.parametrize("swiglu", [False, True])
def test_formula_counts_what_the_model_computes(swiglu):
    """Every matmul of our GPT's forward and backward, counted by torch, equals the non-halved formula."""
    args = SimpleNamespace(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=8,
        kv_channels=8,
        group_query_attention=True,
        num_query_groups=4,
        seq_length=32,
        swiglu=swiglu,
        padded_vocab_size=256,
    )
    counted = run_distributed(1, _count_gpt_flops, swiglu)[0]
    assert counted == pytest.approx(num_floating_point_operations(args, 3, causal_attention=False), rel=1e-6)


def test_throughput_and_mfu_by_hand():
    result = throughput_and_mfu(1e15, elapsed_s=2.0, world_size=4, peak_flops_per_device=250e12)
    assert result.tflops_per_device == pytest.approx(125.0)
    assert result.mfu == pytest.approx(0.5)
    tflops, mfu = throughput_and_mfu(1e15, 2.0, 4, None)
    assert (tflops, mfu) == (pytest.approx(125.0), None)


@pytest.mark.parametrize(
    "elapsed, world_size, peak, message",
    [
        (0.0, 1, None, "elapsed_s must be positive, got 0.0"),
        (1.0, 0, None, "world_size must be a positive integer, got 0"),
        (1.0, 1, -5.0, r"peak_flops_per_device must be positive FLOP/s \(or None for no MFU\), got -5.0"),
    ],
)
def test_throughput_rejects_bad_input(elapsed, world_size, peak, message):
    with pytest.raises(ValueError, match=message):
        throughput_and_mfu(1e12, elapsed, world_size, peak)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("nvidia a100 80gb pcie", 312e12),
        ("NVIDIA GeForce RTX 3090", None),
    ],
)
def test_known_device_peaks(name, peak):
    assert peak_flops_for_device_name(name) == peak


def test_cpu_matmul_peak_takes_the_fastest_repeat(monkeypatch):
    ticks = iter([10.0, 10.5, 11.0, 11.25, 12.0, 12.75])  # repeats of 0.5 s, 0.25 s and 0.75 s
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(ticks))
    assert measured_cpu_matmul_peak_flops(n=32, repeats=3) == 2 * 32**3 / 0.25


def test_cpu_matmul_peak_is_a_real_rate():
    peak = measured_cpu_matmul_peak_flops(torch.bfloat16, n=64, repeats=2)
    assert math.isfinite(peak) and peak > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be a positive integer, got 0"),
        ({"repeats": 1.5}, "repeats must be a positive integer, got 1.5"),
    ],
)
def test_cpu_matmul_peak_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        measured_cpu_matmul_peak_flops(**kwargs)


def test_context_parallelism_spreads_the_same_flops_over_more_ranks():
    """CP splits every sequence, not the work: the batch's FLOPs are unchanged and per-device throughput counts
    the CP ranks in the world size."""
    at_cp1 = num_floating_point_operations(llama3_8b_args(context_parallel_size=1), batch_size=8)
    at_cp4 = num_floating_point_operations(llama3_8b_args(context_parallel_size=4), batch_size=8)
    assert at_cp4 == at_cp1
    dp8 = throughput_and_mfu(at_cp1, 1.0, world_size=8, peak_flops_per_device=None)
    cp4_dp8 = throughput_and_mfu(at_cp4, 1.0, world_size=32, peak_flops_per_device=None)
    assert cp4_dp8.tflops_per_device == pytest.approx(dp8.tflops_per_device / 4)
