"""FLOPs per training iteration (Megatron-LM's formula), achieved TFLOP/s per device, and MFU.

Attention convention: like current Megatron-LM, the core-attention term (``QK^T`` and ``attention x V``) is
**halved for the causal mask**, since only the lower triangle of the score matrix is non-zero. The papers
(Narayanan et al. 2021, Korthikanti et al. 2022 Eq. 7), nanoGPT and torchtitan count the full ``s^2`` matrix;
``causal_attention=False`` gives that convention. MFU figures from tools that pick different conventions are not
comparable for long sequences.

Every matrix multiply is counted three times per step (forward, input-gradient and weight-gradient backward) at
2 FLOPs per multiply-add. Recomputation is not counted: these are *model* FLOPs, so MFU does not rise when
activations are recomputed. Norms, softmax, activations and the optimizer are ignored (well under 1%).
"""

import math
import time
from typing import NamedTuple, Optional

import torch

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.training.model_arithmetic import (
    MAMBA_EXPAND,
    gated_linear_multiplier,
    hybrid_layer_counts,
    moe_layer_pattern,
    num_query_groups,
    required_arg,
)

# Forward + input-gradient + weight-gradient GEMMs, each 2 FLOPs per multiply-add.
_FLOPS_PER_WEIGHT_PER_TOKEN = 3 * 2

# Published dense (no 2:4 sparsity) bf16 tensor-core peaks in FLOP/s per GPU, matched as case-insensitive
# substrings of the CUDA device name, first match wins (so "H100 PCIe" precedes "H100").
# Sources: NVIDIA datasheets list the "with sparsity" figure, twice the dense one:
#   H100 SXM 1,979 / PCIe 1,513 / NVL 1,671 TFLOPS; H200 SXM 1,979 / NVL 1,671; A100 624 (312 dense);
#   B200 (HGX) 4.5 PFLOPS; L40S 733. The 989 TFLOP/s H100 denominator is the one Megatron-LM uses
#   (NVIDIA/Megatron-LM issue #1276); A100's 312 is the peak in Narayanan et al. 2021, Table 1.
KNOWN_DEVICE_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("B200", 2250e12),
    ("L40S", 362e12),
)


def num_floating_point_operations(args, batch_size: int, causal_attention: bool = True) -> float:
    """Training FLOPs of one iteration over ``batch_size`` sequences of ``args.seq_length`` tokens.

    The args are Megatron-LM's (after ``validate_args``): num_layers, hidden_size, ffn_hidden_size,
    num_attention_heads, group_query_attention / num_query_groups, kv_channels, seq_length, swiglu,
    padded_vocab_size, and for MoE num_experts, moe_router_topk, moe_ffn_hidden_size,
    moe_shared_expert_intermediate_size, moe_layer_freq. Per token, with q = kv_channels * heads and
    kv = kv_channels * query_groups:

    - attention projections: ``6 L h (q + 2 kv) + 6 L q h``;
    - core attention: ``6 L q s`` (causal, halved; ``12 L q s`` with ``causal_attention=False``);
    - MLP: ``12 h f x`` per dense layer, ``x`` = 3/2 for SwiGLU; MoE layers count ``topk`` routed experts of size
      ``moe_ffn_hidden_size`` plus the shared experts;
    - logits: ``6 h V``.

    With multi-head attention, f = 4h, GELU and ``causal_attention=False`` this is Korthikanti et al.'s Eq. 7,
    ``72 B s L h^2 (1 + s/(6h) + V/(12 h L))``.

    The count is for the whole batch, so it does not depend on the layout: context parallelism splits the same
    work over more ranks (ring attention skips the masked half of the causal blocks, which the ``s/2`` above
    already leaves out), and :func:`throughput_and_mfu` divides by the world size, CP ranks included.
    Hybrid models (``--hybrid-layer-pattern``) use Megatron-LM's hybrid formula instead
    (:func:`hybrid_floating_point_operations`).
    """
    if getattr(args, "hybrid_layer_pattern", None):
        return hybrid_floating_point_operations(args, batch_size, causal_attention)
    hidden, layers, seq = args.hidden_size, args.num_layers, args.seq_length
    kv_channels = required_arg(args, "kv_channels", "run validate_args or pass --kv-channels")
    vocab = required_arg(args, "padded_vocab_size", "build the tokenizer (it pads the vocabulary) first")
    query_size = kv_channels * args.num_attention_heads
    key_value_size = kv_channels * num_query_groups(args)

    projections = hidden * (query_size + 2 * key_value_size) + query_size * hidden
    # Scores (q per key position) plus attention x V (q per value position), over the visible positions.
    visible_positions = seq / 2 if causal_attention else seq
    core_attention = 2 * query_size * visible_positions
    attention_per_layer = _FLOPS_PER_WEIGHT_PER_TOKEN * (projections + core_attention)

    pattern = moe_layer_pattern(args)
    moe_layers = sum(pattern)
    dense_layers = layers - moe_layers
    mlp_width = dense_layers * required_arg(args, "ffn_hidden_size", "run validate_args or pass --ffn-hidden-size")
    if moe_layers:
        routed = getattr(args, "moe_router_topk", 2) * required_arg(
            args, "moe_ffn_hidden_size", "run validate_args or pass --moe-ffn-hidden-size"
        )
        shared = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
        mlp_width += moe_layers * (routed + shared)
    # Two GEMMs of h x width each (fc1 and fc2), 3/2 of that for SwiGLU.
    mlp = _FLOPS_PER_WEIGHT_PER_TOKEN * 2 * hidden * mlp_width * gated_linear_multiplier(args)

    logits = _FLOPS_PER_WEIGHT_PER_TOKEN * hidden * vocab
    return float(batch_size * seq * (layers * attention_per_layer + mlp + logits))


# ---- hybrid models: Megatron-LM's hybrid_flops --------------------------------------------------------------


def mamba_layer_forward_flops(args, batch_size: int) -> float:
    """Megatron-LM's forward FLOPs of one Mamba layer (``mamba_layer_flops``): in_proj ``2 B s h (2 d + 2 G N +
    H)``, the scan ``7 B s d N`` and out_proj ``2 B s d h``, with Megatron's d = 2 h and H = ``--mamba-num-heads``
    or d / ``--mamba-head-dim``."""
    tokens = batch_size * args.seq_length
    hidden, state, groups = args.hidden_size, args.mamba_state_dim, args.mamba_num_groups
    d_inner = MAMBA_EXPAND * hidden
    heads = args.mamba_num_heads or d_inner // args.mamba_head_dim
    in_proj = 2 * tokens * hidden * (2 * d_inner + 2 * groups * state + heads)
    scan = 7 * tokens * d_inner * state
    out_proj = 2 * tokens * d_inner * hidden
    return in_proj + scan + out_proj


def moe_layer_forward_flops(args, batch_size: int) -> float:
    """Megatron-LM's forward FLOPs of one MoE layer (``moe_layer_flops``): each token through ``--moe-router-topk``
    experts of ``--moe-ffn-hidden-size`` and the shared expert, ``4 B s h (k f_e + f_s) x`` (x = 3/2 with SwiGLU);
    the router's GEMM is not counted, as in Megatron."""
    tokens = batch_size * args.seq_length
    expert_ffn = required_arg(args, "moe_ffn_hidden_size", "run validate_args or pass --moe-ffn-hidden-size")
    shared_ffn = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
    width = args.moe_router_topk * expert_ffn + shared_ffn
    return 4 * tokens * args.hidden_size * width * gated_linear_multiplier(args)


def hybrid_floating_point_operations(args, batch_size: int, causal_attention: bool = True) -> float:
    """Megatron-LM's ``hybrid_flops``: three times (forward + both backward GEMMs) the forward FLOPs of each layer
    kind times its count, plus the logits; MoE layers as :func:`moe_layer_forward_flops`. Attention ``4 B s h p (h + h
    g/n + s/2)`` (p = kv_channels n / h; the
    causal half of the scores, ``s`` instead of ``s/2`` with ``causal_attention=False``), MLP ``4 B s h f x``
    (x = 3/2 with SwiGLU), logits ``2 B s h V``."""
    counts = hybrid_layer_counts(args)
    tokens = batch_size * args.seq_length
    hidden, heads = args.hidden_size, args.num_attention_heads
    kv_channels = required_arg(args, "kv_channels", "run validate_args or pass --kv-channels")
    vocab = required_arg(args, "padded_vocab_size", "build the tokenizer (it pads the vocabulary) first")
    ffn = required_arg(args, "ffn_hidden_size", "run validate_args or pass --ffn-hidden-size")
    query_fraction = kv_channels * heads / hidden
    visible_positions = args.seq_length / 2 if causal_attention else args.seq_length
    attention = (
        4 * tokens * hidden * query_fraction * (hidden + hidden * num_query_groups(args) / heads + visible_positions)
    )
    mlp = 4 * tokens * hidden * ffn * gated_linear_multiplier(args)
    logits = 2 * tokens * hidden * vocab
    forward = (
        counts[Symbols.ATTENTION] * attention
        + counts[Symbols.MLP] * mlp
        + counts[Symbols.MAMBA] * mamba_layer_forward_flops(args, batch_size)
        + (counts[Symbols.MOE] * moe_layer_forward_flops(args, batch_size) if counts[Symbols.MOE] else 0)
        + logits
    )
    return float(3 * forward)


class Throughput(NamedTuple):
    """Achieved model TFLOP/s per device, and MFU (a fraction of the peak; None without a peak)."""

    tflops_per_device: float
    mfu: Optional[float]


def throughput_and_mfu(
    flops_per_iteration: float, elapsed_s: float, world_size: int, peak_flops_per_device: Optional[float]
) -> Throughput:
    """Megatron-LM's ``throughput per GPU (TFLOP/s/GPU)``, ``F / (t * 1e12 * world_size)``, and MFU against
    ``peak_flops_per_device`` (FLOP/s, e.g. 989e12 for an H100 in bf16)."""
    if not elapsed_s > 0:
        raise ValueError(f"elapsed_s must be positive, got {elapsed_s!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if peak_flops_per_device is not None and not peak_flops_per_device > 0:
        raise ValueError(
            f"peak_flops_per_device must be positive FLOP/s (or None for no MFU), got {peak_flops_per_device!r}"
        )
    flops_per_second_per_device = flops_per_iteration / (elapsed_s * world_size)
    mfu = None if peak_flops_per_device is None else flops_per_second_per_device / peak_flops_per_device
    return Throughput(flops_per_second_per_device / 1e12, mfu)


def peak_flops_for_device_name(device_name: str) -> Optional[float]:
    """The published dense bf16 peak (FLOP/s) of a GPU named like ``torch.cuda.get_device_name()`` returns
    (e.g. "NVIDIA H100 80GB HBM3"), or None for a device not in :data:`KNOWN_DEVICE_PEAK_FLOPS`."""
    name = device_name.lower()
    for substring, peak in KNOWN_DEVICE_PEAK_FLOPS:
        if substring.lower() in name:
            return peak
    return None


def measured_cpu_matmul_peak_flops(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of the fastest of ``repeats`` n x n matmuls on this process's CPU threads, after one warm-up.

    CPUs publish no training peak, so MFU on CPU is measured against this: the rate a large, cache-friendly GEMM
    reaches with ``torch.get_num_threads()`` threads (set the thread count per rank first, as the ranks of one host
    share its cores). Takes about ``(repeats + 1) * 2 n^3`` FLOPs: well under a second at the defaults.
    """
    for name, value in (("n", n), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(n, n, generator=generator).to(dtype)
    right = torch.randn(n, n, generator=generator).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.matmul(left, right, out=out)  # warm-up: thread pool start and page faults stay out of the timing
    fastest = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(left, right, out=out)
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * n**3 / fastest
