#!/usr/bin/env bash
# Quickstart: train a small GPT on the built-in Shakespeare corpus with tensor x pipeline parallelism
# (TP=2 x PP=2) on 4 CPU processes (gloo), through Megatron's entry point, and save a checkpoint.
#
#   pip install -e ".[tokenizers]"
#   bash examples/cpu/train_gpt_cpu.sh
#
# On a 2-core machine it took 2 min 48 s idle and 6 min 48 s with other jobs on the same cores (docs/quickstart.md).
# Settings, all optional, from the environment:
#   CHECKPOINT_DIR  where checkpoints go (default /tmp/megatron-lite/gpt_cpu); running the script again resumes
#                   from the latest one there, so raise TRAIN_ITERS to train further (see TRAINING_ARGS)
#   TRAIN_ITERS     training iterations (default 100)
#   DATA_CACHE_DIR  where the dataset's sample indices are cached (default /tmp/megatron-lite/data_cache)
# Extra arguments are passed on to pretrain_gpt.py, e.g. `--dry-run` to only print the rank layout and memory.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export CHECKPOINT_DIR="${CHECKPOINT_DIR:-/tmp/megatron-lite/gpt_cpu}"
export DATA_CACHE_DIR="${DATA_CACHE_DIR:-/tmp/megatron-lite/data_cache}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
NUM_RANKS=4

# One intra-op thread per rank for each core slice; without it every rank would start a thread per core.
CORES="$(python -c 'import os; print(os.cpu_count() or 1)')"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES > NUM_RANKS ? CORES / NUM_RANKS : 1 ))}"

# The tokenized corpus and its tokenizer ship with the package (the .bin/.idx are rebuilt into DATA_CACHE_DIR if
# an installed copy lacks them).
builtin() { python -c "import os; from megatron.training import builtin_data as b; print($1)"; }
DATA_PREFIX="$(builtin 'b.ensure_preprocessed(os.environ["DATA_CACHE_DIR"])')"
VOCAB_FILE="$(builtin 'b.vocab_file()')"
MERGE_FILE="$(builtin 'b.merge_file()')"

DISTRIBUTED_ARGS=(
    --standalone            # single machine, a free rendezvous port
    --nproc_per_node "$NUM_RANKS"
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --distributed-backend gloo
)

# GPT-2-style: learned positions, LayerNorm, GELU, tied input/output embeddings; 5.3M parameters.
GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 256
    --num-attention-heads 8
    --seq-length 256
    --max-position-embeddings 256
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 16  # 4 micro-batches per step keep both pipeline stages busy
    --train-iters "$TRAIN_ITERS"
    --lr 1e-3
    --min-lr 1e-4
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.1
    --adam-beta2 0.95
    --clip-grad 1.0
    --use-distributed-optimizer
    # The LR and weight-decay schedule follows this run's flags, the position in it comes from the checkpoint: so
    # raising TRAIN_ITERS and running again continues training, with warm-up and decay stretched over the new
    # length. Without this flag a resumed run refuses a schedule that differs from the checkpoint's (Megatron-LM's
    # default); --use-checkpoint-opt_param-scheduler would instead keep the checkpoint's schedule.
    --override-opt-param-scheduler
)

# The fused GPU kernels do not exist on a CPU; say so, rather than get a fallback warning.
CPU_ARGS=(
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion
    --no-rope-fusion --no-gradient-accumulation-fusion --no-persist-layer-norm
)

DATA_ARGS=(
    --data-path "$DATA_PREFIX"
    --split 949,50,1
    --tokenizer-type GPT2BPETokenizer
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --data-cache-path "$DATA_CACHE_DIR"
)

CHECKPOINT_AND_LOGGING_ARGS=(
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --save-interval 50
    --log-interval 10
    --log-throughput
    --eval-interval 50
    --eval-iters 5
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_ROOT/pretrain_gpt.py" \
    "${MODEL_PARALLEL_ARGS[@]}" "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${CPU_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${CHECKPOINT_AND_LOGGING_ARGS[@]}" "$@"

TRACKER="$CHECKPOINT_DIR/latest_checkpointed_iteration.txt"
if [[ -f "$TRACKER" ]]; then
    echo "Checkpoint of iteration $(cat "$TRACKER") saved in $CHECKPOINT_DIR"
fi
