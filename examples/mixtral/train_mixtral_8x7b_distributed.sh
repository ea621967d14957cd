#!/usr/bin/env bash
# Pretrain a Mixtral-8x7B-shaped mixture-of-experts model on NVIDIA GPUs with Megatron-LM's flags.
#
#   TOKENIZER_MODEL=/path/to/tokenizer.model DATA_PREFIX=/data/my_corpus_text_document \
#       NUM_NODES=8 NODE_RANK=<0..7> MASTER_ADDR=<node 0> bash examples/mixtral/train_mixtral_8x7b_distributed.sh
#
# Environment:
#   TOKENIZER_MODEL  (required) Mixtral's SentencePiece tokenizer.model (32,000 tokens)
#   DATA_PREFIX      (required) a corpus tokenized with it by tools/preprocess_data.py
#                    (--tokenizer-type Llama2Tokenizer --tokenizer-model $TOKENIZER_MODEL --append-eod)
#   CHECKPOINT_DIR   default ./checkpoints/mixtral_8x7b; TENSORBOARD_DIR default $CHECKPOINT_DIR/tensorboard
#   NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE  (default: 8 nodes of 8 GPUs)
set -euo pipefail

TOKENIZER_MODEL="${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the Mixtral tokenizer.model file}"
DATA_PREFIX="${DATA_PREFIX:?set DATA_PREFIX to a corpus preprocessed with that tokenizer (path without .bin/.idx)}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/mixtral_8x7b}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-$CHECKPOINT_DIR/tensorboard}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

DISTRIBUTED_ARGS=(
    --nproc_per_node "${GPUS_PER_NODE:-8}"
    --nnodes "${NUM_NODES:-8}"
    --node_rank "${NODE_RANK:-0}"
    --master_addr "${MASTER_ADDR:-localhost}"
    --master_port "${MASTER_PORT:-6000}"
)

# Mixtral 8x7B: 32 layers, d_model 4096, 32 query heads sharing 8 key/value heads, RoPE base 1e6, RMSNorm, no
# biases, untied output layer; every layer's MLP is 8 SwiGLU experts of FFN 14336, 2 of them per token.
MODEL_ARGS=(
    --disable-bias-linear
    --seq-length 4096
    --max-position-embeddings 32768
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 8
    --rotary-base 1000000
)

# Top-2 routing with the switch-transformer load-balancing loss, all-to-all token dispatch over the 8 EP ranks,
# the experts of a rank run as one grouped GEMM.
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 256
    --lr 1e-4
    --train-iters 500000
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 500
    --clip-grad 1.0
    --bf16
)

# 64 GPUs: 4 pipeline stages of 8 layers; within each stage 16 data-parallel ranks, and the 8 experts spread
# over 8 of them (EP=8, expert-DP 2). ZeRO-1 sharding of dense and expert optimizer states.
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --data-path "$DATA_PREFIX"
    --split 99990,8,2
)

LOGGING_ARGS=(
    --log-interval 1
    --log-throughput
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --ckpt-format torch_dist
    --tensorboard-dir "$TENSORBOARD_DIR"
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${LOGGING_ARGS[@]}"
