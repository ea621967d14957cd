"""Sizes of hybrid (Mamba / attention / MLP / MoE) models from Megatron-LM's args: parameters per layer kind (exact for
the local hybrid spec), Megatron-LM's hybrid FLOPs formula, and per-layer activation bytes.

A hybrid layer is one of: a Mamba-2 layer (pre-norm + mixer), an attention-only layer (pre-norm + self-attention)
an MLP-only layer (pre-norm + MLP) or an MoE layer (pre-norm + router, routed and shared experts); each has one
norm, where a GPT layer has two.
"""

from typing import Dict, NamedTuple

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, get_hybrid_layer_counts
from megatron.training.flops import gated_linear_multiplier, num_query_groups, required_arg

MAMBA_EXPAND = 2  # d_inner = 2 * hidden (the mixer's default `expand`)
MAMBA_CONV_WIDTH = 4  # the mixer's default `d_conv`


class MambaSizes(NamedTuple):
    d_inner: int
    heads: int
    groups: int
    state: int


def mamba_sizes(args) -> MambaSizes:
    """The mixer's sizes as MambaMixer derives them: ``--mamba-num-heads`` fixes the heads (and d_inner = heads x
    head dim), else d_inner = 2 h and heads = d_inner / ``--mamba-head-dim``."""
    head_dim = args.mamba_head_dim
    if args.mamba_num_heads is not None:
        return MambaSizes(
            args.mamba_num_heads * head_dim, args.mamba_num_heads, args.mamba_num_groups, args.mamba_state_dim
        )
    d_inner = MAMBA_EXPAND * args.hidden_size
    return MambaSizes(d_inner, d_inner // head_dim, args.mamba_num_groups, args.mamba_state_dim)


def hybrid_layer_counts(args) -> Dict[str, int]:
    """Layers of each kind in ``--hybrid-layer-pattern`` (``M``, ``*``, ``-``, ...)."""
    return get_hybrid_layer_counts(args.hybrid_layer_pattern)


def moe_layer_parameters(args, ep: int = 1, etp: int = 1):
    """(split over TP, replicated, routed experts, routed experts on one EP x expert-TP rank) of one hybrid MoE layer
    (``E``): the GPT MoE layer's counts of the layout report without its attention part (attention weights, the
    input norm, the projection bias), since a hybrid MoE layer has only the pre-MLP norm and the MoE MLP."""
    # Imported here: layout_report imports this module.
    from megatron.training.layout_report import _moe_layer_parameters

    split, replicated, experts, experts_per_rank = _moe_layer_parameters(args, ep, etp)
    attention_split, attention_replicated = layer_parameters(args, Symbols.ATTENTION)
    return split - attention_split, replicated - attention_replicated, experts, experts_per_rank


def layer_parameters(args, symbol: str):
    """(parameters split over TP, parameters every TP rank holds in full) of one hybrid layer of kind ``symbol``,
    as the local hybrid spec builds it (linear biases with ``--add-bias-linear``; the mixer has none). For an MoE
    layer the routed experts are in the first number; :func:`moe_layer_parameters` keeps them apart."""
    hidden = args.hidden_size
    norm = hidden * (1 if args.normalization == "RMSNorm" else 2)
    bias = args.add_bias_linear
    if symbol == Symbols.MAMBA:
        sizes = mamba_sizes(args)
        conv_channels = sizes.d_inner + 2 * sizes.groups * sizes.state
        in_proj = hidden * (2 * sizes.d_inner + 2 * sizes.groups * sizes.state + sizes.heads)
        conv = conv_channels * (MAMBA_CONV_WIDTH + 1)  # depthwise weight and bias
        per_head = 3 * sizes.heads  # A_log, D, dt_bias
        split = in_proj + conv + per_head + sizes.d_inner + sizes.d_inner * hidden  # gated-norm weight, out_proj
        return split, norm
    if symbol == Symbols.MOE:
        split, replicated, experts, _ = moe_layer_parameters(args)
        return split + experts, replicated  # the routed experts counted with the split weights
    kv_channels = required_arg(args, "kv_channels", "run validate_args or pass --kv-channels")
    if symbol == Symbols.ATTENTION:
        qkv_width = kv_channels * (args.num_attention_heads + 2 * num_query_groups(args))
        split = hidden * qkv_width + (qkv_width if bias or args.add_qkv_bias else 0)
        split += kv_channels * args.num_attention_heads * hidden
        replicated = norm + (hidden if bias else 0)
        if args.qk_layernorm:
            replicated += 2 * kv_channels * (norm // hidden)
        return split, replicated
    if symbol == Symbols.MLP:
        ffn = required_arg(args, "ffn_hidden_size", "run validate_args or pass --ffn-hidden-size")
        fc1_width = ffn * (2 if args.swiglu else 1)
        split = hidden * fc1_width + (fc1_width if bias else 0) + ffn * hidden
        return split, norm + (hidden if bias else 0)
    raise ValueError(f"no parameter count for hybrid layer kind {symbol!r} (not built here)")


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


def layer_activation_bytes(args, symbol: str) -> float:
    """16-bit activations one hybrid layer keeps for backward, per micro-batch (all TP ranks together), with
    selective recomputation. Attention and MLP layers take their parts of Korthikanti et al.'s ``18 + 4 f/h`` per
    ``s b h``: ``11 + 2`` (attention and its norm) and ``3 + 4 f/h + 2`` (MLP and its norm). A Mamba layer keeps
    its norm input and output (``4 s b h``), in_proj's output (``2 s b (2 d + 2 G N + H)``), the convolved x, B,
    C (``2 s b (d + 2 G N)``), the scan output and the gated norm's output (``4 s b d``) and the dropout mask
    (``s b h``): our estimate, the chunk states of the scan left out. An MoE layer is counted as an MLP layer whose
    width is what one token passes through (``topk`` experts and the shared expert): our estimate, the dispatch
    buffers left out."""
    tokens = args.seq_length * args.micro_batch_size
    hidden = args.hidden_size
    if symbol == Symbols.ATTENTION:
        return tokens * hidden * 13
    if symbol == Symbols.MLP:
        return tokens * hidden * (5 + 4 * args.ffn_hidden_size / hidden)
    if symbol == Symbols.MOE:
        width = args.moe_router_topk * args.moe_ffn_hidden_size + (args.moe_shared_expert_intermediate_size or 0)
        return tokens * hidden * (5 + 4 * width / hidden)
    sizes = mamba_sizes(args)
    group_width = 2 * sizes.groups * sizes.state
    return tokens * (
        5 * hidden
        + 2 * (2 * sizes.d_inner + group_width + sizes.heads)
        + 2 * (sizes.d_inner + group_width)
        + 4 * sizes.d_inner
    )
