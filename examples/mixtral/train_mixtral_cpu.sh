#!/usr/bin/env bash
# A tiny Mixtral-style mixture-of-experts GPT on the built-in Shakespeare corpus, on 2 CPU processes (gloo), with
# expert parallelism: 4 experts (top-2 routing, load-balancing loss), 2 on each rank, tokens exchanged all-to-all.
#
#   bash examples/mixtral/train_mixtral_cpu.sh
#
# It takes about a minute. The log line shows the MoE losses next to the language-model loss
# ("lm loss: ... | load_balancing_loss: ... |"). Settings, all optional, from the environment:
#   CHECKPOINT_DIR  where checkpoints go (default /tmp/megatron-lite/mixtral_cpu); running again resumes from there
#   TRAIN_ITERS     training iterations (default 50)
#   DATA_CACHE_DIR  where the dataset's sample indices are cached (default /tmp/megatron-lite/data_cache)
# Extra arguments are passed on to pretrain_gpt.py, e.g. `--dry-run` to print the rank layout (EP, expert-DP).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export CHECKPOINT_DIR="${CHECKPOINT_DIR:-/tmp/megatron-lite/mixtral_cpu}"
export DATA_CACHE_DIR="${DATA_CACHE_DIR:-/tmp/megatron-lite/data_cache}"
TRAIN_ITERS="${TRAIN_ITERS:-50}"
NUM_RANKS=2

CORES="$(python -c 'import os; print(os.cpu_count() or 1)')"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES > NUM_RANKS ? CORES / NUM_RANKS : 1 ))}"

builtin() { python -c "import os; from megatron.training import builtin_data as b; print($1)"; }
DATA_PREFIX="$(builtin 'b.ensure_preprocessed(os.environ["DATA_CACHE_DIR"])')"
VOCAB_FILE="$(builtin 'b.vocab_file()')"
MERGE_FILE="$(builtin 'b.merge_file()')"

DISTRIBUTED_ARGS=(
    --standalone
    --nproc_per_node "$NUM_RANKS"
)

# Mixtral's architecture at toy size: RMSNorm, RoPE, SwiGLU, GQA, no biases, untied output layer.
MODEL_ARGS=(
    --num-layers 2
    --hidden-size 128
    --ffn-hidden-size 256
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --seq-length 128
    --max-position-embeddings 128
    --normalization RMSNorm
    --position-embedding-type rope
    --rotary-base 1000000
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=(
    --num-experts 4
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall
    --expert-model-parallel-size 2  # 2 experts per rank; the dense layers are data-parallel over both ranks
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 16
    --train-iters "$TRAIN_ITERS"
    --lr 1e-3
    --min-lr 1e-4
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.1
    --clip-grad 1.0
    --use-distributed-optimizer
    --override-opt-param-scheduler  # a rerun with a larger TRAIN_ITERS stretches the schedule (see examples/cpu/)
)

CPU_ARGS=(
    --distributed-backend gloo
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
    --save-interval 25
    --log-interval 5
    --eval-interval 25
    --eval-iters 2
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${CPU_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${CHECKPOINT_AND_LOGGING_ARGS[@]}" "$@"

TRACKER="$CHECKPOINT_DIR/latest_checkpointed_iteration.txt"
if [[ -f "$TRACKER" ]]; then
    echo "Checkpoint of iteration $(cat "$TRACKER") saved in $CHECKPOINT_DIR"
fi
