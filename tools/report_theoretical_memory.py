"""Print the theoretical memory per rank of a training run from its Megatron-LM flags, without building a model.

    python tools/report_theoretical_memory.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 4096 --micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 128255 \\
        --tensor-model-parallel-size 2 --world-size 8 --use-distributed-optimizer --sequence-parallel \\
        --recompute-activations

Give the flags of the run (``parse_args`` and ``validate_args`` check them as ``pretrain_gpt.py`` would; data and
training-length flags may be left out). The tokenizer is built to learn the padded vocabulary size, so give its
usual flags. ``--world-size`` (default: $WORLD_SIZE, else 1) is the number of ranks the run would use.
``--show-layout`` also prints the rank groups and each pipeline stage's layers and parameters. The estimator and
its assumptions are described in megatron/training/theoretical_memory_usage.py and docs/performance-model.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.tokenizers import build_tokenizer  # noqa: E402
from megatron.training.arguments import parse_args_list, validate_args  # noqa: E402
from megatron.training.layout_report import describe_parallel_layout_for_args  # noqa: E402
from megatron.training.theoretical_memory_usage import report_theoretical_memory  # noqa: E402


def add_report_args(parser):
    group = parser.add_argument_group("theoretical memory report")
    # Not "world_size": parse_args sets that from $WORLD_SIZE, and this flag overrides it.
    group.add_argument(
        "--world-size",
        type=int,
        default=None,
        dest="report_world_size",
        help="Number of ranks of the run (default: $WORLD_SIZE, else 1).",
    )
    group.add_argument(
        "--show-layout",
        action="store_true",
        help="Also print the rank groups and each pipeline stage's layers and parameters.",
    )
    return parser


def resolve_args(argv=None):
    """Megatron-LM's args for the run described by ``argv``, validated, with the padded vocabulary size."""
    args = parse_args_list(sys.argv[1:] if argv is None else argv, extra_args_provider=add_report_args)
    if args.report_world_size is not None:
        args.world_size = args.report_world_size
    # A report trains nothing: validate_args then needs no data or training length, as for --dry-run.
    args.dry_run = True
    validate_args(args)
    build_tokenizer(args)
    return args


def main(argv=None) -> None:
    args = resolve_args(argv)
    if args.show_layout:
        print(describe_parallel_layout_for_args(args) + "\n")
    # validate_args checked that the global batch splits into whole micro-batches on every DP rank.
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    report_theoretical_memory(args, num_microbatches=num_microbatches, verbose=True)


if __name__ == "__main__":
    from megatron.training.error_handling import tool_main

    tool_main(main)
