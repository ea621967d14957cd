#!/usr/bin/env bash
# Pretrain the 8B Mamba-2 hybrid of "An Empirical Study of Mamba-based Language Models" (arXiv 2406.07887) on
# NVIDIA GPUs with Megatron-LM's flags: 56 layers (24 Mamba-2, 4 attention, 28 MLP), d_model 4096.
#
#   TOKENIZER_MODEL=/path/to/tokenizer DATA_PREFIX=/data/my_corpus_text_document \
#       bash examples/mamba/train_hybrid_8b.sh
#
# Environment:
#   TOKENIZER_MODEL  (required) a local Hugging Face tokenizer (a directory with tokenizer.json)
#   DATA_PREFIX      (required) a corpus tokenized with it by tools/preprocess_data.py (path without .bin/.idx)
#   CHECKPOINT_DIR   default ./checkpoints/hybrid_8b; TENSORBOARD_DIR default $CHECKPOINT_DIR/tensorboard
#   NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE  as in examples/gpt3/ (default: 1 node of 8 GPUs)
# The Mamba mixer uses mamba-ssm's fused kernels when mamba-ssm is installed, the pure-PyTorch scan otherwise.
set -euo pipefail

TOKENIZER_MODEL="${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a local tokenizer (a directory with tokenizer.json)}"
DATA_PREFIX="${DATA_PREFIX:?set DATA_PREFIX to a corpus preprocessed with that tokenizer (path without .bin/.idx)}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/hybrid_8b}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-$CHECKPOINT_DIR/tensorboard}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

DISTRIBUTED_ARGS=(
    --nproc_per_node "${GPUS_PER_NODE:-8}"
    --nnodes "${NUM_NODES:-1}"
    --node_rank "${NODE_RANK:-0}"
    --master_addr "${MASTER_ADDR:-localhost}"
    --master_port "${MASTER_PORT:-6000}"
)

# The pattern sets the 56 layers (no --num-layers). Mamba-2: state 128, heads of 64 (2 x 4096 / 64 = 128 heads) in
# 8 groups. Attention: 32 query heads sharing 8 key/value heads; no position embedding (the Mamba layers carry
# position). RMSNorm, no biases, untied output layer.
HYBRID_MODEL_ARGS=(
    --hybrid-layer-pattern "M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-"
    --hidden-size 4096
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --mamba-state-dim 128
    --mamba-head-dim 64
    --mamba-num-groups 8
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type none
    --normalization RMSNorm
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --init-method-std 0.02
    --hidden-dropout 0.0
    --attention-dropout 0.0
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 768
    --train-samples 268554688
    --lr-warmup-samples 3000000
    --lr-decay-samples 255126953
    --lr 2.5e-4
    --min-lr 2.5e-5
    --lr-decay-style cosine
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
)

# TP=4 with sequence parallelism within a node (Mamba heads and groups split 4 ways), data parallel across the rest,
# ZeRO-1 optimizer sharding.
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 4
    --pipeline-model-parallel-size 1
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

DATA_ARGS=(
    --data-path "$DATA_PREFIX"
    --split 99,1,0
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 2000
    --eval-iters 32
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --save-interval 2000
    --ckpt-format torch_dist
    --tensorboard-dir "$TENSORBOARD_DIR"
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_ROOT/pretrain_hybrid.py" \
    "${HYBRID_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
