#!/usr/bin/env bash
# Train the tiny GPT that docs/inference.md serves: 2 layers, hidden 64, 64-token sequences, on the built-in
# Shakespeare corpus, in one CPU process, saving a checkpoint to serve with examples/inference/serve_tiny_gpt.sh.
#
#   bash examples/inference/train_tiny_gpt.sh
#
# A log line every 20 iterations; 200 iterations took 39-73 s on a busy 2-core machine (docs/inference.md).
# Settings, all optional, from the environment:
#   CHECKPOINT_DIR  where the checkpoint goes (default checkpoints/tiny; serve_tiny_gpt.sh reads it there)
#   TRAIN_ITERS     training iterations (default 200)
# Extra arguments are passed on to pretrain_gpt.py.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/tiny}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"

# torchrun sets one thread per rank only when it starts several; with one rank PyTorch would start a thread per
# core, and on a small or busy machine those threads wait on each other: the run is slower, not faster. A model
# this small gains nothing from a second thread.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

builtin() { python -c "from megatron.training import builtin_data as b; print($1)"; }

MODEL_ARGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64)
DATA_ARGS=(
    --tokenizer-type GPT2BPETokenizer --vocab-file "$(builtin 'b.vocab_file()')" --merge-file "$(builtin 'b.merge_file()')"
    --data-path "$(builtin 'b.data_prefix()')" --split 98,2,0
)
# The fused GPU kernels do not exist on a CPU; say so, rather than get a fallback warning.
CPU_ARGS=(
    --distributed-backend gloo --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion
    --no-bias-dropout-fusion --no-rope-fusion --no-gradient-accumulation-fusion --no-persist-layer-norm
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 8 --train-iters "$TRAIN_ITERS" --lr 1e-3
    --log-interval 20 --eval-iters 0
    --save "$CHECKPOINT_DIR" --save-interval "$TRAIN_ITERS"
)

torchrun --standalone --nproc_per_node 1 "$REPO_ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${CPU_ARGS[@]}" "${TRAINING_ARGS[@]}" "$@"
