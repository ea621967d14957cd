#!/bin/bash
# Written for megatron-lite's tests in the style of Megatron-LM's examples/mamba/train.sh (not a copy): a Mamba
# hybrid chosen by a case statement, its options in one string, launched from examples/mamba with a relative path.
# Usage: train_hybrid_mamba.sh DATA_PREFIX TOKENIZER_MODEL

MODEL_SCALE="small"
case "${MODEL_SCALE}" in
    "small")
        TP=2
        PATTERN="M-M*-M-"
        HIDDEN=1024
        HEADS=16
        ;;
    *)
        echo "unknown MODEL_SCALE ${MODEL_SCALE}"
        exit 1
        ;;
esac

DATA_PATH=$1
TOKENIZER_PATH=$2
export NCCL_IB_SL=1
export TRITON_CACHE_DIR="./triton-cache/"
mkdir -p ./checkpoints

options=" \
       --tensor-model-parallel-size ${TP} \
       --sequence-parallel \
       --hybrid-layer-pattern ${PATTERN} \
       --hidden-size ${HIDDEN} \
       --num-attention-heads ${HEADS} \
       --group-query-attention \
       --num-query-groups 8 \
       --position-embedding-type none \
       --seq-length 4096 \
       --max-position-embeddings 4096 \
       --train-samples 50000000 \
       --lr-warmup-samples 10000 \
       --lr-decay-samples 49990000 \
       --lr 3e-4 \
       --min-lr 3e-5 \
       --lr-decay-style cosine \
       --micro-batch-size 4 \
       --global-batch-size 256 \
       --normalization RMSNorm \
       --disable-bias-linear \
       --untie-embeddings-and-output-weights \
       --data-path ${DATA_PATH} \
       --split 99,1,0 \
       --tokenizer-type GPTSentencePieceTokenizer \
       --tokenizer-model ${TOKENIZER_PATH} \
       --distributed-backend nccl \
       --save ./checkpoints \
       --save-interval 2000 \
       --log-interval 10 \
       --eval-iters 8 \
       --bf16 \
       --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec"

torchrun --nproc_per_node 8 ../../pretrain_hybrid.py ${options}
