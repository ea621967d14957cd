#!/bin/bash
# Written for megatron-lite's tests in the style of Megatron-LM's examples/gpt3 launch script (not a copy): a large
# GPT with tensor and pipeline parallelism, fp16, positional arguments and bash arrays expanded on the torchrun line.
# Usage: train_gpt_tp_pp.sh CHECKPOINT_DIR TENSORBOARD_DIR VOCAB_FILE MERGE_FILE DATA_PREFIX

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
NUM_NODES=2
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
MERGE_FILE=$4
DATA_PATH=$5

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr localhost
    --master_port 6000
)

MODEL_ARGS=(
    --num-layers 48
    --hidden-size 6144
    --num-attention-heads 48
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 1024
    --rampup-batch-size 32 32 1000000
    --train-iters 250000
    --lr 1.2e-4
    --min-lr 1.2e-5
    --lr-decay-style cosine
    --lr-warmup-fraction .01
    --weight-decay 0.1
    --clip-grad 1.0
    --fp16
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 4
    --pipeline-model-parallel-size 4
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --tokenizer-type GPT2BPETokenizer
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 969,30,1
)

LOGGING_ARGS=(
    --log-interval 50
    --eval-interval 2000
    --eval-iters 20
    --save-interval 5000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${LOGGING_ARGS[@]}
