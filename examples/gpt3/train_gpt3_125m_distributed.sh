#!/usr/bin/env bash
# GPT-3 pretraining on NVIDIA GPUs with Megatron-LM's flags: the 125M model by default, the larger GPT-3 shapes
# with MODEL_SIZE.
#
#   bash examples/gpt3/train_gpt3_125m_distributed.sh CHECKPOINT_DIR TENSORBOARD_DIR VOCAB_FILE MERGE_FILE DATA_PREFIX
#
# VOCAB_FILE / MERGE_FILE: GPT-2's BPE files (gpt2-vocab.json, gpt2-merges.txt); DATA_PREFIX: a corpus made by
# tools/preprocess_data.py (path without .bin/.idx). Environment, all optional:
#   MODEL_SIZE      125M (default), 350M, 1.3B, 2.7B, 6.7B, 13B or 175B
#   NUM_NODES       nodes (default: the fewest that hold one model replica, GPUS_PER_NODE GPUs each)
#   NODE_RANK       this node's rank (default 0); MASTER_ADDR / MASTER_PORT: node 0's address (default localhost:6000)
#   GPUS_PER_NODE   default 8
# Run the same command on every node with its NODE_RANK, or see examples/slurm/sbatch_gpt.sh.
set -euo pipefail

if [[ $# -ne 5 ]]; then
    echo "usage: $0 CHECKPOINT_DIR TENSORBOARD_DIR VOCAB_FILE MERGE_FILE DATA_PREFIX" >&2
    exit 2
fi
CHECKPOINT_DIR=$1
TENSORBOARD_DIR=$2
VOCAB_FILE=$3
MERGE_FILE=$4
DATA_PREFIX=$5
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# Shapes and optimiser settings of Brown et al. 2020 ("Language Models are Few-Shot Learners"), Table 2.1:
# layers, d_model, heads, d_head, learning rate and batch size in tokens (here in 2048-token sequences:
# 0.5M -> 256, 1M -> 512, 2M -> 1024, 3.2M -> 1536). TP x PP is a starting point for 80 GB GPUs.
MODEL_SIZE="${MODEL_SIZE:-125M}"
case "$MODEL_SIZE" in
    #     layers        d_model          heads         d_head           lr         batch              TP    PP     micro-batch
    125M) NUM_LAYERS=12; HIDDEN_SIZE=768;   NUM_HEADS=12; KV_CHANNELS=64;  LR=6.0e-4; GLOBAL_BATCH=256;  TP=1; PP=1;  MICRO_BATCH=8 ;;
    350M) NUM_LAYERS=24; HIDDEN_SIZE=1024;  NUM_HEADS=16; KV_CHANNELS=64;  LR=3.0e-4; GLOBAL_BATCH=256;  TP=1; PP=1;  MICRO_BATCH=8 ;;
    # GPT-3 XL's attention is wider than d_model (24 heads x 128 = 3072), hence --kv-channels.
    1.3B) NUM_LAYERS=24; HIDDEN_SIZE=2048;  NUM_HEADS=24; KV_CHANNELS=128; LR=2.0e-4; GLOBAL_BATCH=512;  TP=1; PP=1;  MICRO_BATCH=4 ;;
    2.7B) NUM_LAYERS=32; HIDDEN_SIZE=2560;  NUM_HEADS=32; KV_CHANNELS=80;  LR=1.6e-4; GLOBAL_BATCH=512;  TP=2; PP=1;  MICRO_BATCH=4 ;;
    6.7B) NUM_LAYERS=32; HIDDEN_SIZE=4096;  NUM_HEADS=32; KV_CHANNELS=128; LR=1.2e-4; GLOBAL_BATCH=1024; TP=4; PP=1;  MICRO_BATCH=2 ;;
    # The paper prints d_model 5140 for 13B; 40 heads x 128 = 5120 is the model that was trained.
    13B)  NUM_LAYERS=40; HIDDEN_SIZE=5120;  NUM_HEADS=40; KV_CHANNELS=128; LR=1.0e-4; GLOBAL_BATCH=1024; TP=8; PP=1;  MICRO_BATCH=1 ;;
    175B) NUM_LAYERS=96; HIDDEN_SIZE=12288; NUM_HEADS=96; KV_CHANNELS=128; LR=0.6e-4; GLOBAL_BATCH=1536; TP=8; PP=16; MICRO_BATCH=1 ;;
    *) echo "unknown MODEL_SIZE=$MODEL_SIZE; use 125M, 350M, 1.3B, 2.7B, 6.7B, 13B or 175B" >&2; exit 2 ;;
esac
MIN_LR="$(awk "BEGIN { print $LR / 10 }")"  # cosine decay to 10% of the peak
# Smaller std for the widest model, as Megatron-LM's 175B recipe uses; 0.02 (GPT-2's) otherwise.
INIT_METHOD_STD=0.02
if [[ "$MODEL_SIZE" == 175B ]]; then
    INIT_METHOD_STD=0.006
fi

GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MIN_NODES=$(( (TP * PP + GPUS_PER_NODE - 1) / GPUS_PER_NODE ))
NUM_NODES="${NUM_NODES:-$MIN_NODES}"

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "${NODE_RANK:-0}"
    --master_addr "${MASTER_ADDR:-localhost}"
    --master_port "${MASTER_PORT:-6000}"
)

GPT_MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS"
    --kv-channels "$KV_CHANNELS"
    --ffn-hidden-size $(( 4 * HIDDEN_SIZE ))
    --seq-length 2048
    --max-position-embeddings 2048
    --position-embedding-type learned_absolute
    --attention-backend auto
)

# 300B tokens of training, LR warm-up over 375M tokens and cosine decay to 10% over 260B tokens (the paper's
# schedule), counted in 2048-token samples.
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "$GLOBAL_BATCH"
    --train-samples 146484375
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style cosine
    --lr-warmup-samples 183105
    --lr-decay-samples 126953125
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std "$INIT_METHOD_STD"
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
if (( TP > 1 )); then
    MODEL_PARALLEL_ARGS+=(--sequence-parallel)
fi

DATA_ARGS=(
    --data-path "$DATA_PREFIX"
    --split 949,50,1
    --tokenizer-type GPT2BPETokenizer
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --log-throughput
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --ckpt-format torch_dist
    --async-save
    --tensorboard-dir "$TENSORBOARD_DIR"
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_ROOT/pretrain_gpt.py" \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
