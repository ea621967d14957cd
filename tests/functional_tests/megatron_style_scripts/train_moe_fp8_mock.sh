#!/bin/bash
# Written for megatron-lite's tests in the style of Megatron-LM's examples/llama and examples/mixtral launch scripts
# (not a copy): a GQA/SwiGLU MoE model with expert and pipeline parallelism, FP8 flags added in a conditional block,
# the flex dispatcher, and mock data selected by default with several words per array entry.
# Usage: train_moe_fp8_mock.sh [CHECKPOINT_DIR] [TOKENIZER|MOCK]

CHECKPOINT_PATH=${1:-"checkpoints/moe_fp8"}
TOKENIZER_ARG=${2:-"MOCK"}
DTYPE="fp8"
PRETRAIN_SCRIPT_PATH="pretrain_gpt.py"
mkdir -p "$(dirname "$CHECKPOINT_PATH")"

DISTRIBUTED_ARGS=(--nproc_per_node 8 --nnodes 4 --node_rank ${NODE_RANK:-0} --master_addr localhost --master_port 6000)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 24
    --hidden-size 2048
    --ffn-hidden-size 7168
    --num-attention-heads 16
    --group-query-attention
    --num-query-groups 4
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --rope-type rope
    --rotary-base 500000
    --swiglu
    --normalization RMSNorm
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=(
    --num-experts 16
    --moe-layer-freq [0]*2+[1]*22
    --moe-ffn-hidden-size 1792
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-permute-fusion
    --moe-token-dispatcher-type flex
    --moe-flex-dispatcher-backend deepep
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 512
    --train-samples 100000000
    --lr-warmup-samples 200000
    --lr-decay-samples 99000000
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --bf16
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --cross-entropy-loss-fusion
)

DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(
        "--fp8-format hybrid"
        "--fp8-amax-history-len 1024"
        "--fp8-amax-compute-algo max"
    )
fi

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8
    --sequence-parallel
)

DATA_ARGS=()
if [[ "$TOKENIZER_ARG" == "MOCK" ]]; then
    DATA_ARGS+=(
        "--mock-data"
        "--tokenizer-type NullTokenizer"
        "--vocab-size 131072"
        "--split '99,1,0'"
        "--no-create-attention-mask-in-dataloader"
    )
else
    DATA_ARGS+=("--tokenizer-type HuggingFaceTokenizer" "--tokenizer-model $TOKENIZER_ARG" "--data-path corpus")
fi

LOGGING_ARGS=(
    --log-interval 10
    --eval-interval 1000
    --eval-iters 16
    --save "$CHECKPOINT_PATH"
    --save-interval 1000
    --log-throughput
    --profile
)

if [ ! -f "$PRETRAIN_SCRIPT_PATH" ]; then
    echo "Run this script from the root of the Megatron-LM checkout" >&2
    exit 1
fi

torchrun ${DISTRIBUTED_ARGS[@]} $PRETRAIN_SCRIPT_PATH \
    ${MODEL_ARGS[@]} ${MOE_ARGS[@]} ${TRAINING_ARGS[@]} ${DTYPE_ARGS[@]} \
    ${PARALLEL_ARGS[@]} ${DATA_ARGS[@]} ${LOGGING_ARGS[@]}
