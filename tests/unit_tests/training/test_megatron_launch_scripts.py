"""The command lines of Megatron-LM's own launch scripts get through argument parsing here.

Each list below holds the pretrain arguments of one of Megatron-LM's example scripts (examples/gpt3/
train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh, examples/mixtral/
train_mixtral_8x7b_distributed.sh, examples/mamba/train.sh), with their paths replaced by placeholders. Every flag
must parse; validation then either accepts the run or stops it with one "not supported yet" message naming the
feature and its flag, never with an unknown-flag error.
"""

import sys

import pytest

from megatron.training import builtin_data
from megatron.training.arguments import parse_args, validate_args

GPT3_175B = """
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
    --attention-backend auto
    --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 --train-iters 500000
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
    --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    --data-path DATA --vocab-file VOCAB --merge-file MERGES --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --save CKPT --load CKPT --eval-iters 10
    --tensorboard-dir TB
"""

LLAMA3_8B_FP8 = """
    --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
    --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
    --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
    --untie-embeddings-and-output-weights --disable-bias-linear
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
    --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
    --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path CACHE --tiktoken-pattern v2
    --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
    --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
    --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
    --save CKPT --load CKPT --tensorboard-dir TB
"""

MIXTRAL = """
    --use-mcore-models --disable-bias-linear --seq-length 256 --max-position-embeddings 2048 --num-layers 2
    --hidden-size 256 --ffn-hidden-size 896 --num-attention-heads 2 --init-method-std 0.01 --attention-dropout 0.0
    --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion
    --no-position-embedding --rotary-base 1000000
    --num-experts 2 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
    --tokenizer-type Llama2Tokenizer --tokenizer-model TOKENIZER --mock-data --split 99990,8,2
    --micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 7 --min-lr 1.0e-5 --weight-decay 0.1
    --clip-grad 1.0
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2
    --use-distributed-optimizer --sequence-parallel
    --eval-iters 10 --no-load-optim --no-load-rng
"""

MAMBA = """
    --tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 1 --use-distributed-optimizer
    --overlap-param-gather --overlap-grad-reduce --untie-embeddings-and-output-weights --init-method-std 0.02
    --position-embedding-type none --num-layers 48 --hidden-size 1024 --num-attention-heads 16
    --group-query-attention --num-query-groups 8 --hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5
    --seq-length 4096 --max-position-embeddings 4096 --train-samples 73242188 --lr-warmup-samples 50000
    --lr-decay-samples 73192188 --save CKPT --load CKPT --data-path DATA --data-cache-path CACHE --split 99,1,0
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model TOKENIZER --distributed-backend nccl
    --micro-batch-size 4 --global-batch-size 32 --lr 2.5e-4 --min-lr 2.5e-5 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --disable-bias-linear
    --normalization RMSNorm --adam-beta1 0.9 --adam-beta2 0.95 --log-interval 10 --save-interval 2000
    --eval-interval 2000 --eval-iters 32 --bf16 --use-mcore-models
    --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec --no-create-attention-mask-in-dataloader
    --tensorboard-dir TB
"""

SCRIPTS = {
    "gpt3_175b": (GPT3_175B, 128),
    "llama3_8b_fp8": (LLAMA3_8B_FP8, 8),
    "mixtral_8x7b": (MIXTRAL, 2),
    "mamba": (MAMBA, 8),
}


def _placeholders(tmp_path) -> dict:
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"")
    return {
        "DATA": builtin_data.data_prefix(), "VOCAB": builtin_data.vocab_file(), "MERGES": builtin_data.merge_file(),
        "TOKENIZER": str(tokenizer), "CKPT": str(tmp_path / "ckpt"), "TB": str(tmp_path / "tb"),
        "CACHE": str(tmp_path / "cache"),
    }


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_megatron_launch_script_parses_and_validates_or_names_what_is_missing(name, monkeypatch, tmp_path):
    flags, world_size = SCRIPTS[name]
    paths = _placeholders(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *(paths.get(a, a) for a in flags.split())])
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    args = parse_args()  # an unknown flag would exit here
    try:
        validate_args(args)
    except ValueError as error:
        assert "not supported yet" in str(error), f"{name}: {error}"
