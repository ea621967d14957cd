"""Parameter counts of a model, per layer, from Megatron-LM's ``args``: the one place that knows how many weights
each layer kind builds (exact for the local GPT and hybrid layer specs, biases included). FLOPs (``flops``), memory
(``theoretical_memory_usage``) and the layout report (``layout_report``) all count from here.

Counts come as ``(split, replicated)``: the parameters split over tensor parallelism and those every TP rank holds
in full. MoE counts add the routed experts, whole and on one EP x expert-TP rank. A GPT layer is an attention part
(input norm, QKV, projection) and an MLP part (pre-MLP norm, fc1, fc2); a hybrid layer (``--hybrid-layer-pattern``)
is one of those parts alone, a Mamba-2 mixer with its norm, or an MoE MLP with its norm.
"""

from typing import Dict, List, NamedTuple, Tuple

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, get_hybrid_layer_counts

MAMBA_EXPAND = 2  # d_inner = 2 * hidden (the mixer's default `expand`)
MAMBA_CONV_WIDTH = 4  # the mixer's default `d_conv`


def required_arg(args, name: str, fix: str):
    """``args.<name>``, or a ValueError naming the field and how to set it when it is missing or None."""
    value = getattr(args, name, None)
    if value is None:
        raise ValueError(f"args.{name} is not set; {fix}")
    return value


def num_query_groups(args) -> int:
    """Key/value heads: ``num_query_groups`` with ``--group-query-attention``, else one per attention head."""
    if getattr(args, "group_query_attention", False):
        return required_arg(args, "num_query_groups", "pass --num-query-groups with --group-query-attention")
    return args.num_attention_heads


def gated_linear_multiplier(args) -> float:
    """SwiGLU's fc1 has two halves, so the MLP holds 3 matrices of h x f instead of 2."""
    return 3 / 2 if args.swiglu else 1


def moe_layer_pattern(args) -> List[int]:
    """1 for each MoE layer, 0 for each dense one (Megatron's ``--moe-layer-freq``: an int k makes every k-th layer
    from layer 0 MoE; a list gives the pattern). All dense without ``--num-experts``."""
    if getattr(args, "num_experts", None) is None:
        return [0] * args.num_layers
    frequency = getattr(args, "moe_layer_freq", 1)
    if isinstance(frequency, int):
        if frequency < 1:
            raise ValueError(f"--moe-layer-freq must be a positive integer or a list of 0/1, got {frequency}")
        return [1 if layer % frequency == 0 else 0 for layer in range(args.num_layers)]
    pattern = list(frequency)
    if len(pattern) != args.num_layers or any(flag not in (0, 1) for flag in pattern):
        raise ValueError(
            f"--moe-layer-freq pattern {pattern} must have one 0/1 entry per layer ({args.num_layers} layers)"
        )
    return pattern


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


def _norm(args) -> int:
    return args.hidden_size * (1 if args.normalization == "RMSNorm" else 2)


def attention_parameters(args) -> Tuple[int, int]:
    """(split, replicated) of the attention part of a layer: input norm, QKV and projection (with
    ``--qk-layernorm`` the query and key norms). Column-parallel QKV splits weight and bias; the row-parallel
    projection splits only its weight."""
    hidden, bias = args.hidden_size, args.add_bias_linear
    kv_channels = required_arg(args, "kv_channels", "run validate_args or pass --kv-channels")
    qkv_width = kv_channels * (args.num_attention_heads + 2 * num_query_groups(args))
    split = hidden * qkv_width + (qkv_width if bias or args.add_qkv_bias else 0)
    split += kv_channels * args.num_attention_heads * hidden
    replicated = _norm(args) + (hidden if bias else 0)
    if args.qk_layernorm:
        replicated += 2 * kv_channels * (_norm(args) // hidden)
    return split, replicated


def mlp_parameters(args) -> Tuple[int, int]:
    """(split, replicated) of the dense MLP part of a layer: pre-MLP norm, fc1 (column-parallel: weight and bias
    split) and fc2 (row-parallel: its bias whole on every TP rank)."""
    hidden, bias = args.hidden_size, args.add_bias_linear
    ffn = required_arg(args, "ffn_hidden_size", "run validate_args or pass --ffn-hidden-size")
    fc1_width = ffn * (2 if args.swiglu else 1)
    split = hidden * fc1_width + (fc1_width if bias else 0) + ffn * hidden
    return split, _norm(args) + (hidden if bias else 0)


def moe_mlp_parameters(args, ep: int = 1, etp: int = 1) -> Tuple[int, int, int, int]:
    """(split, replicated, routed experts, routed experts on one EP x expert-TP rank) of the MoE MLP part of a
    layer: the pre-MLP norm, the router (one row per expert), the shared expert (split over TP like a dense MLP, its
    gate replicated) and the routed experts (fc1 weight and bias and fc2 weight split over expert-TP, fc2 bias whole
    on every expert-TP rank). A hybrid MoE layer (``E``) is exactly this."""
    hidden, bias = args.hidden_size, args.add_bias_linear
    num_experts = args.num_experts
    expert_ffn = required_arg(args, "moe_ffn_hidden_size", "run validate_args or pass --moe-ffn-hidden-size")
    shared_ffn = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
    glu = 2 if args.swiglu else 1
    split = 0
    replicated = _norm(args) + hidden * num_experts + (num_experts if bias else 0)  # norm, router
    if shared_ffn:
        split += hidden * shared_ffn * glu + (shared_ffn * glu if bias else 0) + shared_ffn * hidden
        replicated += (hidden if bias else 0) + (hidden if getattr(args, "moe_shared_expert_gate", False) else 0)
    expert_split = hidden * expert_ffn * glu + (expert_ffn * glu if bias else 0) + expert_ffn * hidden
    expert_whole = hidden if bias else 0
    experts = num_experts * (expert_split + expert_whole)
    experts_per_rank = num_experts // ep * (expert_split // etp + expert_whole)
    return split, replicated, experts, experts_per_rank


def transformer_layer_parameters(args) -> Tuple[int, int]:
    """(split, replicated) of one dense GPT transformer layer: attention and MLP parts."""
    attention_split, attention_replicated = attention_parameters(args)
    mlp_split, mlp_replicated = mlp_parameters(args)
    return attention_split + mlp_split, attention_replicated + mlp_replicated


def transformer_moe_layer_parameters(args, ep: int = 1, etp: int = 1) -> Tuple[int, int, int, int]:
    """(split, replicated, routed experts, routed experts on one rank) of one GPT MoE layer: the attention part and
    the MoE MLP part."""
    attention_split, attention_replicated = attention_parameters(args)
    split, replicated, experts, experts_per_rank = moe_mlp_parameters(args, ep, etp)
    return attention_split + split, attention_replicated + replicated, experts, experts_per_rank


def mamba_layer_parameters(args) -> Tuple[int, int]:
    """(split, replicated) of one Mamba-2 layer: its norm and the mixer (in_proj, depthwise conv with bias, A_log /
    D / dt_bias per head, the gated norm's weight and out_proj; no linear biases)."""
    hidden = args.hidden_size
    sizes = mamba_sizes(args)
    conv_channels = sizes.d_inner + 2 * sizes.groups * sizes.state
    in_proj = hidden * (2 * sizes.d_inner + 2 * sizes.groups * sizes.state + sizes.heads)
    conv = conv_channels * (MAMBA_CONV_WIDTH + 1)  # depthwise weight and bias
    per_head = 3 * sizes.heads  # A_log, D, dt_bias
    split = in_proj + conv + per_head + sizes.d_inner + sizes.d_inner * hidden  # gated-norm weight, out_proj
    return split, _norm(args)


def hybrid_layer_parameters(args, symbol: str) -> Tuple[int, int]:
    """(split, replicated) of one hybrid layer of kind ``symbol``, as the local hybrid spec builds it. For an MoE
    layer the routed experts are in the first number; :func:`moe_mlp_parameters` keeps them apart."""
    if symbol == Symbols.MAMBA:
        return mamba_layer_parameters(args)
    if symbol == Symbols.MOE:
        split, replicated, experts, _ = moe_mlp_parameters(args)
        return split + experts, replicated  # the routed experts counted with the split weights
    if symbol == Symbols.ATTENTION:
        return attention_parameters(args)
    if symbol == Symbols.MLP:
        return mlp_parameters(args)
    raise ValueError(f"no parameter count for hybrid layer kind {symbol!r} (not built here)")
