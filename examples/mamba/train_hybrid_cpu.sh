#!/usr/bin/env bash
# Quickstart: train a small Mamba-2 hybrid on the built-in Shakespeare corpus with tensor parallelism (TP=2) and
# sequence parallelism on 2 CPU processes (gloo), through Megatron's entry point, and save a checkpoint.
#
#   pip install -e ".[tokenizers]"
#   bash examples/mamba/train_hybrid_cpu.sh
#
# The model is five layers, "M*-M-": Mamba, attention, MLP, Mamba, MLP (Nemotron-H's layer kinds), 2.8M parameters.
# Settings, all optional, from the environment:
#   CHECKPOINT_DIR  where checkpoints go (default /tmp/megatron-lite/hybrid_cpu); running the script again resumes
#                   from the latest one there
#   TRAIN_ITERS     training iterations (default 100)
#   DATA_CACHE_DIR  where the dataset's sample indices are cached (default /tmp/megatron-lite/data_cache)
# Extra arguments are passed on to pretrain_hybrid.py, e.g. `--dry-run` to only print the layout and memory.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export CHECKPOINT_DIR="${CHECKPOINT_DIR:-/tmp/megatron-lite/hybrid_cpu}"
export DATA_CACHE_DIR="${DATA_CACHE_DIR:-/tmp/megatron-lite/data_cache}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
NUM_RANKS=2

CORES="$(python -c 'import os; print(os.cpu_count() or 1)')"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES > NUM_RANKS ? CORES / NUM_RANKS : 1 ))}"

builtin() { python -c "import os; from megatron.training import builtin_data as b; print($1)"; }
DATA_PREFIX="$(builtin 'b.ensure_preprocessed(os.environ["DATA_CACHE_DIR"])')"
VOCAB_FILE="$(builtin 'b.vocab_file()')"
MERGE_FILE="$(builtin 'b.merge_file()')"

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --sequence-parallel
    --distributed-backend gloo
)

# The pattern sets the number of layers (no --num-layers). Mamba heads: 2 * 128 / 32 = 8 in 2 groups (one per TP
# rank); grouped-query attention with 2 key/value heads; squared-ReLU MLP; no position embedding (Mamba layers
# carry position).
HYBRID_MODEL_ARGS=(
    --hybrid-layer-pattern "M*-M-"
    --hidden-size 128
    --ffn-hidden-size 512
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --mamba-state-dim 16
    --mamba-head-dim 32
    --mamba-num-groups 2
    --squared-relu
    --normalization RMSNorm
    --disable-bias-linear
    --position-embedding-type none
    --seq-length 128
    --untie-embeddings-and-output-weights
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 8
    --train-iters "$TRAIN_ITERS"
    --lr 2e-3
    --min-lr 2e-4
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.1
    --adam-beta2 0.95
    --clip-grad 1.0
    --use-distributed-optimizer
    --override-opt-param-scheduler
)

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

torchrun --standalone --nproc_per_node "$NUM_RANKS" "$REPO_ROOT/pretrain_hybrid.py" \
    "${MODEL_PARALLEL_ARGS[@]}" "${HYBRID_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${CPU_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${CHECKPOINT_AND_LOGGING_ARGS[@]}" "$@"

TRACKER="$CHECKPOINT_DIR/latest_checkpointed_iteration.txt"
if [[ -f "$TRACKER" ]]; then
    echo "Checkpoint of iteration $(cat "$TRACKER") saved in $CHECKPOINT_DIR"
fi
