"""Theoretical memory per rank for training: weights + optimizer state, and activations (Megatron-LM's estimator).

Everything is for the most loaded rank: the first pipeline stage, which holds the word embedding and, under the
1F1B schedule, activations for ``pp`` micro-batches of its ``L/pp`` layers (i.e. ``L`` layers' worth).

Weights and optimizer assume bf16 training with Adam: bf16 parameters (2 bytes), fp32 gradients (4) and fp32 main
parameters, momentum and variance (12): **18 bytes per parameter**, or **6 + 12/d** with the distributed optimizer,
which shards the 12 bytes of fp32 optimizer state over the d data-parallel ranks (ZeRO-1; expert parameters use
the expert data-parallel size). Parameters are counted from the shapes without linear-layer biases.

Activations follow Korthikanti et al. 2022 (arXiv 2205.05198), 16-bit activations, 1-byte dropout masks:

- with sequence parallelism and selective recomputation, ``s b h (18 + 4 f/h) / t`` per layer (Table 2's
  ``34 s b h / t`` for f = 4h), plus the embedding input and dropout and, with one stage, the output layer and loss;
- otherwise Table 2's "tensor parallel + selective recompute" row, ``s b h (10 + 24/t)`` per layer, plus the same
  extras and 5% for temporaries. Neither includes the ``5 a s^2 b`` attention-score term: both assume the scores
  are recomputed (selective recomputation) or never stored (flash attention).

The interleaved schedule multiplies activations by ``1 + (p - 1)/(p v)``; 1F1B with fewer micro-batches than
stages by ``m / p``. Context parallelism gives every rank ``s / cp`` of each sequence, so every activation term is
divided by ``cp`` (ring attention's two in-flight key/value blocks, ``4 (s/cp) b n_kv d`` bytes per layer being
computed, are temporaries and not counted). Full recomputation and MoE token routing are not modelled.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.core.rank_generator import check_layout
from megatron.core.utils import print_rank_0
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.training.model_arithmetic import (
    gated_linear_multiplier,
    hybrid_layer_counts,
    hybrid_layer_parameters,
    mamba_sizes,
    moe_layer_pattern,
    moe_mlp_parameters,
    num_query_groups,
    required_arg,
)

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of one transformer layer's parts and of the whole model, as Megatron's estimator counts them."""

    attention: float
    dense_mlp: float
    shared_experts: float
    routed_experts: float
    active_routed_experts: float
    layer_norms: float
    router: float
    shared_expert_gate: float
    embedding: float
    final_norm: float
    num_dense_layers: int
    num_moe_layers: int
    untied_output: bool
    # Hybrid models (--hybrid-layer-pattern) count their Mamba / attention / MLP layers and the non-expert part of
    # their MoE layers here instead (the GPT layer parts are then 0; routed_experts and num_moe_layers are the MoE
    # layers' routed experts).
    hybrid_split_in_block: float = 0.0
    hybrid_replicated_in_block: float = 0.0

    @property
    def tensor_parallel_in_block(self) -> float:
        """Weights split over tensor-parallel ranks (attention, dense and shared-expert MLPs)."""
        return (
            (self.attention + self.dense_mlp) * self.num_dense_layers
            + (self.attention + self.shared_experts) * self.num_moe_layers
            + self.hybrid_split_in_block
        )

    @property
    def replicated_in_block(self) -> float:
        """Weights every tensor-parallel rank holds in full (norms, routers)."""
        moe_extras = self.router + self.shared_expert_gate
        return (
            self.layer_norms * self.num_dense_layers
            + (self.layer_norms + moe_extras) * self.num_moe_layers
            + self.hybrid_replicated_in_block
            + self.final_norm
        )

    @property
    def expert_parallel_in_block(self) -> float:
        """Routed-expert weights, split over expert-tensor x expert-model parallel ranks."""
        return self.routed_experts * self.num_moe_layers

    @property
    def transformer_block(self) -> float:
        return self.tensor_parallel_in_block + self.replicated_in_block + self.expert_parallel_in_block

    @property
    def active_transformer_block(self) -> float:
        """As transformer_block, with only ``moe_router_topk`` routed experts per MoE layer."""
        unused_experts = (self.routed_experts - self.active_routed_experts) * self.num_moe_layers
        return self.transformer_block - unused_experts

    @property
    def embedding_layers(self) -> float:
        return self.embedding * (2 if self.untied_output else 1)


def count_parameters(args) -> ParameterCounts:
    """Parameter counts from Megatron-LM's args (``validate_args`` and the tokenizer's ``padded_vocab_size`` done)."""
    if getattr(args, "hybrid_layer_pattern", None):
        return _count_hybrid_parameters(args)
    hidden = args.hidden_size
    heads = args.num_attention_heads
    kv_channels = required_arg(args, "kv_channels", "run validate_args or pass --kv-channels")
    ffn = required_arg(args, "ffn_hidden_size", "run validate_args or pass --ffn-hidden-size")
    vocab = required_arg(args, "padded_vocab_size", "build the tokenizer (it pads the vocabulary) first")
    glu = gated_linear_multiplier(args)
    # RMSNorm has a weight; LayerNorm a weight and a bias.
    norm_size = 1 if args.normalization == "RMSNorm" else 2

    pattern = moe_layer_pattern(args)
    num_experts = getattr(args, "num_experts", None)
    if num_experts is None:
        expert_ffn, top_k, num_experts_or_zero = 0, 0, 0
    else:
        expert_ffn = required_arg(args, "moe_ffn_hidden_size", "run validate_args or pass --moe-ffn-hidden-size")
        top_k, num_experts_or_zero = getattr(args, "moe_router_topk", 2), num_experts
    shared_ffn = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
    add_bias_linear = getattr(args, "add_bias_linear", True)

    # QKV is h x (q + 2 kv) and the output projection q x h: 2 h q (1 + g/n) in all.
    query_size = kv_channels * heads
    attention = 2 * hidden * query_size * (1 + num_query_groups(args) / heads)
    router = hidden * num_experts_or_zero + (num_experts_or_zero if add_bias_linear else 0)
    shared_gate = hidden if shared_ffn > 0 and getattr(args, "moe_shared_expert_gate", False) else 0
    return ParameterCounts(
        attention=attention,
        dense_mlp=2 * hidden * ffn * glu,
        shared_experts=2 * hidden * shared_ffn * glu,
        routed_experts=2 * hidden * expert_ffn * num_experts_or_zero * glu,
        active_routed_experts=2 * hidden * expert_ffn * top_k * glu,
        layer_norms=2 * hidden * norm_size,
        router=router,
        shared_expert_gate=shared_gate,
        embedding=hidden * vocab,
        final_norm=norm_size * hidden,
        num_dense_layers=len(pattern) - sum(pattern),
        num_moe_layers=sum(pattern),
        untied_output=bool(args.untie_embeddings_and_output_weights),
    )


def _count_hybrid_parameters(args) -> ParameterCounts:
    """A hybrid model's counts: each layer of the pattern by its kind (model_arithmetic), exactly as built."""

    split = replicated = 0.0
    counts = hybrid_layer_counts(args)
    for symbol, count in counts.items():
        if count and symbol != Symbols.MOE:
            layer_split, layer_replicated = hybrid_layer_parameters(args, symbol)
            split, replicated = split + count * layer_split, replicated + count * layer_replicated
    # MoE layers: router, norm and shared expert with the layers above; routed experts split over EP x expert-TP.
    routed = active_routed = 0
    if counts[Symbols.MOE]:
        moe_split, moe_replicated, routed, _ = moe_mlp_parameters(args)
        split, replicated = split + counts[Symbols.MOE] * moe_split, replicated + counts[Symbols.MOE] * moe_replicated
        active_routed = routed / args.num_experts * args.moe_router_topk
    vocab = required_arg(args, "padded_vocab_size", "build the tokenizer (it pads the vocabulary) first")
    return ParameterCounts(
        attention=0,
        dense_mlp=0,
        shared_experts=0,
        routed_experts=routed,
        active_routed_experts=active_routed,
        layer_norms=0,
        router=0,
        shared_expert_gate=0,
        embedding=args.hidden_size * vocab,
        final_norm=args.hidden_size * (1 if args.normalization == "RMSNorm" else 2),
        num_dense_layers=0,
        num_moe_layers=counts[Symbols.MOE],
        untied_output=bool(args.untie_embeddings_and_output_weights),
        hybrid_split_in_block=split,
        hybrid_replicated_in_block=replicated,
    )


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


_HYBRID_LAYER_NAMES = {"M": "Mamba", "*": "attention", "-": "MLP", "E": "MoE"}


def _hybrid_block_activations(args, tp: int, sequence_parallel: bool, verbose: bool = False) -> float:
    """Activation bytes of a hybrid model's layers on one TP rank (``tp`` 1: all ranks together): with sequence
    parallelism everything is split over TP; without it each layer's norm input and output and dropout mask
    (``5 s b h``) are replicated."""
    replicated_per_layer = 5 * args.seq_length * args.micro_batch_size * args.hidden_size
    memory = 0.0
    for symbol, count in hybrid_layer_counts(args).items():
        if count:
            layer = layer_activation_bytes(args, symbol)
            replicated = 0 if sequence_parallel else replicated_per_layer
            per_rank = replicated + (layer - replicated) / tp
            memory += count * per_rank
            if verbose:
                shown = per_rank / (args.tensor_model_parallel_size if sequence_parallel else 1)
                print_rank_0(
                    f"Activation memory footprint per {_HYBRID_LAYER_NAMES[symbol]} layer: "
                    f"{shown / NUM_BYTES_IN_MEGABYTE:.1f} MB"
                )
    return memory


def bytes_per_parameter(use_distributed_optimizer: bool, data_parallel_size: int) -> float:
    """bf16 weights (2) + fp32 grads (4) + fp32 main weights, Adam m and v (12, sharded with the distributed
    optimizer): 18, or 6 + 12/d."""
    return 6 + 12 / data_parallel_size if use_distributed_optimizer else 18


def compute_weight_and_optimizer_memory(args, verbose: bool = False) -> float:
    """Bytes of weights, gradients and optimizer state on the most loaded rank (the first pipeline stage)."""
    counts = count_parameters(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    ep = getattr(args, "expert_model_parallel_size", 1)
    data_parallel_size = required_arg(args, "data_parallel_size", "run validate_args (it derives it)")
    world_size = required_arg(args, "world_size", "set WORLD_SIZE or run parse_args")
    cp = getattr(args, "context_parallel_size", 1)
    _, expert_data_parallel_size = check_layout(world_size, tp, pp, cp, ep, etp)

    if verbose:
        _print_billions("Number of parameters in transformer block", counts.transformer_block)
        if counts.num_moe_layers:
            _print_billions("Number of active parameters in transformer block", counts.active_transformer_block)
        _print_billions("Number of parameters in embedding layers", counts.embedding_layers)
        _print_billions("Total number of parameters", counts.transformer_block + counts.embedding_layers)

    # The first stage holds 1/pp of the block plus the word embedding.
    tensor_parallel_on_shard = (counts.tensor_parallel_in_block / pp + counts.embedding) / tp
    if counts.untied_output and pp == 1:
        tensor_parallel_on_shard += counts.embedding / tp
    replicated_on_shard = counts.replicated_in_block / pp
    expert_parallel_on_shard = counts.expert_parallel_in_block / pp / (etp * ep)
    if verbose:
        on_shard = tensor_parallel_on_shard + replicated_on_shard + expert_parallel_on_shard
        _print_billions("Number of parameters in most loaded shard", on_shard, digits=4)
        if pp > 1:
            on_other_shards = (
                counts.tensor_parallel_in_block / (pp * tp)
                + counts.replicated_in_block / pp
                + counts.expert_parallel_in_block / (pp * etp * ep)
            )
            _print_billions("Number of parameters in other shards", on_other_shards, digits=4)

    distributed = bool(args.use_distributed_optimizer)
    dense_bytes = bytes_per_parameter(distributed, data_parallel_size)
    expert_bytes = bytes_per_parameter(distributed, expert_data_parallel_size)
    return (tensor_parallel_on_shard + replicated_on_shard) * dense_bytes + expert_parallel_on_shard * expert_bytes


def _print_billions(what: str, count: float, digits: int = 2) -> None:
    print_rank_0(f"{what} in billions: {count / 10**9:.{digits}f}")


def _tokens_per_rank(args) -> float:
    """Tokens of one micro-batch on one rank: context parallelism splits every sequence over ``cp`` ranks."""
    return args.seq_length * args.micro_batch_size / getattr(args, "context_parallel_size", 1)


def _embedding_activations(args) -> float:
    """Token ids (8-byte) and the embedding dropout mask for the ``pp`` micro-batches in flight on stage 0."""
    tokens = _tokens_per_rank(args)
    pp = args.pipeline_model_parallel_size
    return 8 * tokens * pp + tokens * args.hidden_size * pp


def _pipeline_schedule_factor(args, num_microbatches: Optional[int], verbose: bool) -> float:
    """How many micro-batches' worth of ``L`` layers the first stage holds, relative to the 1F1B steady state."""
    pp = args.pipeline_model_parallel_size
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp is not None:
        # Interleaving warms up with extra chunks in flight (Korthikanti et al. 2022, Sec. 4.2.3).
        penalty = 1 + (pp - 1) / (pp * vpp)
        if verbose:
            print_rank_0(f"Memory penalty from interleaved schedule: {penalty:.2f}")
            print_rank_0(f"Number of in-flight microbatches: {math.ceil(penalty * pp)}")
        return penalty
    if pp > 1:
        factor, in_flight = 1.0, pp
        if num_microbatches is not None:
            # Fewer micro-batches than stages: the first stage never has pp in flight.
            factor, in_flight = min(1, num_microbatches / pp), min(num_microbatches, pp)
        if verbose:
            print_rank_0(f"Number of in-flight microbatches: {in_flight}")
        return factor
    return 1.0


def compute_activation_memory(args, num_microbatches: Optional[int], verbose: bool = False) -> float:
    """Activation bytes on the first stage with sequence parallelism and selective recomputation (Table 2 of
    Korthikanti et al. 2022 with Megatron's ``18 + 4 f/h`` per-layer term), all divided by the TP size (and the
    sequence by the CP size)."""
    sbh = _tokens_per_rank(args) * args.hidden_size
    per_layer = sbh * (18 + 4 * args.ffn_hidden_size / args.hidden_size)
    if getattr(args, "hybrid_layer_pattern", None):
        blocks = _hybrid_block_activations(args, 1, sequence_parallel=True, verbose=verbose)  # / TP below
    else:
        if verbose:
            per_layer_mb = per_layer / NUM_BYTES_IN_MEGABYTE / args.tensor_model_parallel_size
            print_rank_0(f"Activation memory footprint per transformer layer: {per_layer_mb:.1f} MB")
        blocks = per_layer * args.num_layers
    memory = blocks + _embedding_activations(args)
    memory *= _pipeline_schedule_factor(args, num_microbatches, verbose)
    if args.pipeline_model_parallel_size == 1:
        # Input of the output layer and the fp32 logits / cross-entropy.
        memory += sbh * 4 * (1 + args.padded_vocab_size / args.hidden_size)
    return memory / args.tensor_model_parallel_size


def compute_activation_memory_without_sp(args, num_microbatches: Optional[int], verbose: bool = False) -> float:
    """Activation bytes on the first stage without sequence parallelism: ``s b h (10 + 24/t)`` per layer (the
    ``10 s b h`` of norm inputs, QKV/fc1 inputs and dropout masks is replicated on every TP rank), plus 5%."""
    tp = args.tensor_model_parallel_size
    tokens = _tokens_per_rank(args)
    per_layer = tokens * args.hidden_size * (10 + 24 / tp)
    if getattr(args, "hybrid_layer_pattern", None):
        blocks = _hybrid_block_activations(args, tp, sequence_parallel=False, verbose=verbose)
    else:
        if verbose:
            print_rank_0(
                "Activation memory footprint per transformer layer (without SP): "
                f"{per_layer / NUM_BYTES_IN_MEGABYTE:.1f} MB"
            )
        blocks = per_layer * args.num_layers
    memory = blocks + _embedding_activations(args)
    memory *= _pipeline_schedule_factor(args, num_microbatches, verbose)
    if args.pipeline_model_parallel_size == 1:
        # 16-bit logits (split over TP) and final-norm output.
        memory += 2 * (tokens * args.padded_vocab_size / tp + tokens * args.hidden_size)
    # Headroom for temporaries the per-layer accounting leaves out.
    return memory * 1.05


def report_theoretical_memory(
    args, num_microbatches: Optional[int] = None, verbose: bool = False
) -> Tuple[float, float, float]:
    """Print and return (weight and optimizer, activation, total) in MB (MiB) for the most loaded rank.

    ``num_microbatches`` (per iteration) only matters for 1F1B with fewer micro-batches than pipeline stages.
    """
    weight_and_optimizer = compute_weight_and_optimizer_memory(args, verbose=verbose) / NUM_BYTES_IN_MEGABYTE
    if args.sequence_parallel and args.recompute_granularity == "selective":
        activation = compute_activation_memory(args, num_microbatches, verbose=verbose)
    else:
        activation = compute_activation_memory_without_sp(args, num_microbatches, verbose=verbose)
    activation /= NUM_BYTES_IN_MEGABYTE
    total = weight_and_optimizer + activation
    print_rank_0(
        f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer:.2f} MB, "
        f"activation={activation:.2f} MB, total={total:.2f} MB\n"
    )
    return weight_and_optimizer, activation, total
