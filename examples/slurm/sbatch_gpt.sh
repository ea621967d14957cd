#!/usr/bin/env bash
# Multi-node GPT training under SLURM: one `torchrun` per node (srun), which starts one rank per GPU and meets the
# other nodes through a c10d rendezvous on the first node.
#
#   cd megatron-lite
#   DATA_PREFIX=/data/corpus_text_document VOCAB_FILE=... MERGE_FILE=... sbatch examples/slurm/sbatch_gpt.sh
#
# The model is GPT-3 1.3B (see examples/gpt3/ for the other sizes) with TP=2 inside each node and data parallelism
# across all of them. The job stops itself, after saving, EXIT_MARGIN_MINS before the time limit below; submit it
# again (or use --dependency=afterany) and it resumes from CHECKPOINT_DIR.
#
#SBATCH --job-name=megatron-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# sbatch runs a copy of this file, so paths are relative to the submission directory (the repository root).
REPO_ROOT="${REPO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
DATA_PREFIX="${DATA_PREFIX:?set DATA_PREFIX to a corpus made by tools/preprocess_data.py (path without .bin/.idx)}"
VOCAB_FILE="${VOCAB_FILE:?set VOCAB_FILE to GPT-2's vocab.json}"
MERGE_FILE="${MERGE_FILE:?set MERGE_FILE to GPT-2's merges.txt}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$REPO_ROOT/checkpoints/gpt_1.3b}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
TIME_LIMIT_MINS=240   # keep equal to --time above
EXIT_MARGIN_MINS="${EXIT_MARGIN_MINS:-15}"

# Rendezvous on the job's first node; the job id keeps concurrent jobs on shared nodes apart.
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")  # (no `| head`: SIGPIPE under pipefail)
MASTER_ADDR="${NODES[0]}"
MASTER_PORT="${MASTER_PORT:-29500}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

LAUNCHER_ARGS=(
    --nnodes "$SLURM_NNODES"
    --nproc_per_node "$GPUS_PER_NODE"
    --rdzv_id "$SLURM_JOB_ID"
    --rdzv_backend c10d
    --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
)

TRAINING_ARGS=(
    # GPT-3 1.3B (Brown et al. 2020, Table 2.1)
    --num-layers 24 --hidden-size 2048 --num-attention-heads 24 --kv-channels 128
    --seq-length 2048 --max-position-embeddings 2048
    --micro-batch-size 4 --global-batch-size 512
    --train-samples 146484375 --lr-warmup-samples 183105 --lr-decay-samples 126953125
    --lr 2.0e-4 --min-lr 2.0e-5 --lr-decay-style cosine
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
    --bf16
    # layout: TP=2 (with sequence parallelism) x data parallel over the rest
    --tensor-model-parallel-size 2 --sequence-parallel
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --distributed-timeout-minutes 30
    # data
    --data-path "$DATA_PREFIX" --split 949,50,1
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    # checkpoints: resume from the latest; stop (after saving) before SLURM's time limit kills the job
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 2000 --async-save
    --exit-duration-in-mins $(( TIME_LIMIT_MINS - EXIT_MARGIN_MINS ))
    # logging
    --log-interval 100 --log-throughput --eval-interval 2000 --eval-iters 10
    --tensorboard-dir "$CHECKPOINT_DIR/tensorboard"
)

srun --kill-on-bad-exit=1 torchrun "${LAUNCHER_ARGS[@]}" "$REPO_ROOT/pretrain_gpt.py" "${TRAINING_ARGS[@]}"
