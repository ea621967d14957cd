#!/usr/bin/env bash
# Pretrain a Llama-3-8B-shaped model on NVIDIA GPUs with Megatron-LM's flags.
#
#   TOKENIZER_MODEL=/path/to/Meta-Llama-3-8B DATA_PREFIX=/data/my_corpus_text_document \
#       bash examples/llama/train_llama3_8b.sh
#
# Environment:
#   TOKENIZER_MODEL  (required) a local Hugging Face tokenizer for Llama 3: a directory with tokenizer.json (or its
#                    hub name, if the machine can reach the hub); its 128,256-token vocabulary sizes the model
#   DATA_PREFIX      (required) a corpus tokenized with that tokenizer by tools/preprocess_data.py
#                    (--tokenizer-type HuggingFaceTokenizer --tokenizer-model $TOKENIZER_MODEL --append-eod)
#   CHECKPOINT_DIR   default ./checkpoints/llama3_8b; TENSORBOARD_DIR default $CHECKPOINT_DIR/tensorboard
#   NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE  as in examples/gpt3/ (default: 1 node of 8 GPUs)
set -euo pipefail

TOKENIZER_MODEL="${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a local Llama 3 tokenizer (a directory with tokenizer.json)}"
DATA_PREFIX="${DATA_PREFIX:?set DATA_PREFIX to a corpus preprocessed with that tokenizer (path without .bin/.idx)}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/llama3_8b}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-$CHECKPOINT_DIR/tensorboard}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

DISTRIBUTED_ARGS=(
    --nproc_per_node "${GPUS_PER_NODE:-8}"
    --nnodes "${NUM_NODES:-1}"
    --node_rank "${NODE_RANK:-0}"
    --master_addr "${MASTER_ADDR:-localhost}"
    --master_port "${MASTER_PORT:-6000}"
)

# Llama 3 8B: 32 layers, d_model 4096, SwiGLU FFN 14336, 32 query heads sharing 8 key/value heads (GQA),
# RoPE with base 500000 and Llama 3.1's long-context frequency scaling, RMSNorm, no biases, untied output layer.
LLAMA_MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --seq-length 8192
    --max-position-embeddings 8192
    --position-embedding-type rope
    --rotary-base 500000
    --rotary-percent 1.0
    --use-rope-scaling
    --rope-scaling-factor 8
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --make-vocab-size-divisible-by 128  # 128256 is a multiple already: no padding
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --init-method-std 0.02
)

# About 1M tokens per step (128 x 8192), AdamW with Llama's betas and decay, cosine schedule.
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 128
    --train-iters 250000
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --clip-grad 1.0
    --bf16
    --recompute-activations  # selective: attention's softmax/dropout recomputed, the rest kept
)

# TP=4 with sequence parallelism within a node, data parallel across the rest, ZeRO-1 optimizer sharding.
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
    --split 99990,8,2
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --save-interval 1000
    --ckpt-format torch_dist
    --async-save
    --tensorboard-dir "$TENSORBOARD_DIR"
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_ROOT/pretrain_gpt.py" \
    "${LLAMA_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
