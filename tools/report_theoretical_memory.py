"""Print the theoretical memory per rank of a training run from its Megatron-LM flags, without building a model.

    python tools/report_theoretical_memory.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 4096 --micro-batch-size 1 --vocab-size 128256 --tensor-model-parallel-size 2 \\
        --world-size 8 --use-distributed-optimizer --sequence-parallel --recompute-activations

``--world-size`` (default: $WORLD_SIZE, else 1) is the number of ranks the run would use; the data-parallel size
follows from it. ``--show-layout`` also prints the rank groups and each pipeline stage's layers and parameters.
The estimator and its assumptions are described in megatron/training/theoretical_memory_usage.py and
docs/performance-model.md.

Only the flags the estimate reads are parsed here (Megatron-LM's names and defaults); every other flag is
rejected, so a typo cannot silently change the result.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.tokenizers import vocab_size_with_padding  # noqa: E402
from megatron.training.layout_report import describe_parallel_layout_for_args  # noqa: E402
from megatron.training.theoretical_memory_usage import report_theoretical_memory  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model = parser.add_argument_group("model shape (Megatron-LM flags)")
    model.add_argument("--num-layers", type=int, required=True)
    model.add_argument("--hidden-size", type=int, required=True)
    model.add_argument("--ffn-hidden-size", type=int, default=None)
    model.add_argument("--num-attention-heads", type=int, required=True)
    model.add_argument("--group-query-attention", action="store_true")
    model.add_argument("--num-query-groups", type=int, default=1)
    model.add_argument("--kv-channels", type=int, default=None)
    model.add_argument("--seq-length", type=int, required=True)
    model.add_argument("--max-position-embeddings", type=int, default=None)
    model.add_argument(
        "--position-embedding-type", choices=["learned_absolute", "rope", "none"], default="learned_absolute"
    )
    model.add_argument("--swiglu", action="store_true")
    model.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    model.add_argument("--add-qkv-bias", action="store_true")
    model.add_argument("--qk-layernorm", action="store_true")
    model.add_argument("--vocab-size", type=int, required=True, help="the tokenizer's vocabulary size")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128)

    moe = parser.add_argument_group("mixture of experts (Megatron-LM flags)")
    moe.add_argument("--num-experts", type=int, default=None)
    moe.add_argument("--moe-router-topk", type=int, default=2)
    moe.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    moe.add_argument("--moe-layer-freq", type=int, default=1)

    parallel = parser.add_argument_group("parallelism and batch (Megatron-LM flags)")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    parallel.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    parallel.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    parallel.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    parallel.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    parallel.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    parallel.add_argument("--context-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-model-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    parallel.add_argument("--use-tp-pp-dp-mapping", action="store_true")
    parallel.add_argument("--sequence-parallel", action="store_true")
    parallel.add_argument("--use-distributed-optimizer", action="store_true")
    parallel.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    parallel.add_argument(
        "--recompute-activations", action="store_true", help="same as --recompute-granularity selective"
    )
    parallel.add_argument("--micro-batch-size", type=int, required=True)
    parallel.add_argument("--global-batch-size", type=int, default=None)

    report = parser.add_argument_group("this report")
    report.add_argument(
        "--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
        help="number of ranks of the run (default: $WORLD_SIZE, else 1)",
    )
    report.add_argument("--show-layout", action="store_true", help="also print rank groups and pipeline stages")
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in what Megatron-LM's validate_args and tokenizer derive from the flags; reject inconsistent ones."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if args.world_size % (tp * pp * cp) != 0:
        raise SystemExit(
            f"error: --world-size {args.world_size} is not divisible by tensor x pipeline x context parallel sizes "
            f"({tp} x {pp} x {cp}); pass the number of ranks the run would use"
        )
    args.data_parallel_size = args.world_size // (tp * pp * cp)
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.ffn_hidden_size is None:
        # Megatron-LM's SwiGLU default keeps the MLP's parameter count near 8h^2, rounded down to a multiple of 64.
        hidden = args.hidden_size
        args.ffn_hidden_size = int(4 * hidden * 2 / 3 / 64) * 64 if args.swiglu else 4 * hidden
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads != 0:
            raise SystemExit(
                f"error: --hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads}; pass --kv-channels"
            )
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    args.virtual_pipeline_model_parallel_size = _virtual_stages_per_rank(args)
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    return args


def _virtual_stages_per_rank(args: argparse.Namespace):
    if args.num_virtual_stages_per_pipeline_rank is not None:
        return args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage is None:
        return None
    layers_per_rank, remainder = divmod(args.num_layers, args.pipeline_model_parallel_size)
    if remainder or layers_per_rank % args.num_layers_per_virtual_pipeline_stage:
        raise SystemExit(
            f"error: --num-layers {args.num_layers} does not split into {args.pipeline_model_parallel_size} stages "
            f"of chunks of --num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
        )
    return layers_per_rank // args.num_layers_per_virtual_pipeline_stage


def num_microbatches(args: argparse.Namespace):
    """Micro-batches per iteration when --global-batch-size is given (1F1B with fewer than pp holds less)."""
    if args.global_batch_size is None:
        return None
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step != 0:
        raise SystemExit(
            f"error: --global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size x "
            f"data-parallel size ({args.micro_batch_size} x {args.data_parallel_size})"
        )
    return args.global_batch_size // per_step


def main(argv=None) -> None:
    args = resolve_args(build_parser().parse_args(argv))
    try:
        if args.show_layout:
            print(describe_parallel_layout_for_args(args) + "\n")
        report_theoretical_memory(args, num_microbatches=num_microbatches(args), verbose=True)
    except ValueError as error:
        raise SystemExit(f"error: {error}")


if __name__ == "__main__":
    main()
