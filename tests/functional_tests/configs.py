"""The command lines the functional tests share: tiny GPTs on the built-in Shakespeare corpus, fp32, CPU ranks.

Flags here hold no paths (the data, tokenizer and output directories are added per run), so the golden-values
file can record them and notice when they change.
"""

from typing import List, Sequence

# A 2-layer GPT with dropout, two micro-batches per step (gradient accumulation), warm-up then cosine decay,
# validation every 10 iterations. Its loss curve is the golden record; resuming it must reproduce it exactly.
GOLDEN_FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--hidden-dropout",
    "0.1",
    "--attention-dropout",
    "0.1",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--train-iters",
    "20",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "3",
    "--lr-decay-iters",
    "20",
    "--weight-decay",
    "0.01",
    "--clip-grad",
    "1.0",
    "--seed",
    "1234",
    "--log-interval",
    "1",
    "--eval-interval",
    "10",
    "--eval-iters",
    "2",
]

# 4 layers so PP2 x VPP2 has one layer per model chunk; micro-batch 2 so DP4 still has a micro-batch per rank;
# no dropout and layout-independent initialisation, so every layout trains the same model on the same batches.
# The LR schedule is pinned by --lr-decay-iters, so runs of different lengths share it.
EQUIVALENCE_FLAGS = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--use-cpu-initialization",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "3",
    "--lr-decay-iters",
    "20",
    "--seed",
    "1234",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
]
EQUIVALENCE_ITERS = 10
# The single-process reference runs past EQUIVALENCE_ITERS so runs resumed from iteration 10 have a curve to meet.
EQUIVALENCE_REFERENCE_ITERS = 15

# Layouts that must train like the single process: (name, ranks, flags).
PARALLEL_LAYOUTS = [
    (
        "tp2_pp2_distopt",
        4,
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
    ),
    ("dp4_distopt", 4, ["--use-distributed-optimizer"]),
    ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2_vpp2", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    # An uneven custom layout: the embedding and one layer on the first stage, three layers and the loss on the last.
    ("pp2_layout_uneven", 2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tttL"]),
    # Context parallelism (ring attention) inside pipeline stages and data-parallel replicas: CP2 x PP2 x DP2.
    ("cp2_pp2_dp2", 8, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
]


def with_flag(flags: Sequence[str], name: str, value: str) -> List[str]:
    """`flags` with `name`'s value replaced (or the flag appended when absent)."""
    flags = list(flags)
    if name in flags:
        flags[flags.index(name) + 1] = value
    else:
        flags += [name, value]
    return flags
