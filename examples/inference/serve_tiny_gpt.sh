#!/usr/bin/env bash
# Serve the checkpoint of examples/inference/train_tiny_gpt.sh at TP=2 on two CPU ranks (the checkpoint, saved at
# TP=1, is resharded on load), with the OpenAI-compatible API on http://0.0.0.0:$PORT (docs/inference.md).
#
#   bash examples/inference/serve_tiny_gpt.sh          # Ctrl-C stops it
#
# Settings, all optional, from the environment: CHECKPOINT_DIR (default checkpoints/tiny), PORT (default 5000).
# Extra arguments are passed on to tools/run_text_generation_server.py.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/tiny}"
PORT="${PORT:-5000}"
NUM_RANKS=2

# Each rank gets its share of the cores (torchrun would give each one thread; say it here, where it can be changed).
CORES="$(python -c 'import os; print(os.cpu_count() or 1)')"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES > NUM_RANKS ? CORES / NUM_RANKS : 1 ))}"

builtin() { python -c "from megatron.training import builtin_data as b; print($1)"; }

# The model flags are the training run's (--use-checkpoint-args would read them from the checkpoint instead).
MODEL_ARGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64)
TOKENIZER_ARGS=(
    --tokenizer-type GPT2BPETokenizer --vocab-file "$(builtin 'b.vocab_file()')" --merge-file "$(builtin 'b.merge_file()')"
)
CPU_ARGS=(
    --distributed-backend gloo --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion
    --no-bias-dropout-fusion --no-rope-fusion --no-gradient-accumulation-fusion --no-persist-layer-norm
)

torchrun --standalone --nproc_per_node "$NUM_RANKS" "$REPO_ROOT/tools/run_text_generation_server.py" \
    "${MODEL_ARGS[@]}" "${TOKENIZER_ARGS[@]}" "${CPU_ARGS[@]}" \
    --tensor-model-parallel-size "$NUM_RANKS" --load "$CHECKPOINT_DIR" --port "$PORT" "$@"
