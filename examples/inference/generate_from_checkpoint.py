"""Generate text offline from a checkpoint saved by pretrain_gpt.py or pretrain_hybrid.py, at any TP/PP layout.

    torchrun --nproc_per_node 2 examples/inference/generate_from_checkpoint.py \\
        --tensor-model-parallel-size 2 --distributed-backend gloo \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --load /tmp/megatron-lite/gpt_cpu \\
        --prompts "ROMEO:" "First Citizen:" --num-tokens-to-generate 32 --top_k 1

The model flags are pretrain_gpt.py's (with ``--hybrid-layer-pattern``, pretrain_hybrid.py's HybridModel;
``--use-checkpoint-args`` reads them from the checkpoint); the layout flags pick the layout to generate at, whatever
the layout that saved it (the checkpoint is resharded on load). The sampling flags apply to every prompt:
``--temperature``, ``--top_k`` (1: greedy), ``--top_p``, ``--seed`` (reproducible samples), ``--return-log-probs``,
``--stop-words``. Rank 0 prints one JSON line per prompt.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron.core.inference.apis.llm import MegatronLLM  # noqa: E402
from megatron.core.inference.config import InferenceConfig  # noqa: E402
from megatron.core.inference.sampling_params import SamplingParams  # noqa: E402
from megatron.training import get_args, get_model, get_tokenizer  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.checkpointing import load_checkpoint  # noqa: E402
from megatron.training.error_handling import exit_on_error, tool_main  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402

# Generation needs no optimizer state, training length or RNG state from the checkpoint.
GENERATE_ARGS_DEFAULTS = {
    "micro_batch_size": 1,
    "no_load_rng": True,
    "no_load_optim": True,
    "exit_on_missing_checkpoint": True,
}


def add_generate_args(parser):
    group = parser.add_argument_group(title="offline generation")
    group.add_argument("--prompts", nargs="+", required=True, help="Prompts to complete.")
    group.add_argument("--num-tokens-to-generate", type=int, default=32, help="New tokens per prompt (at most).")
    group.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (0: greedy).")
    group.add_argument("--top_k", type=int, default=0, help="Top-k sampling (0: off, 1: greedy).")
    group.add_argument("--top_p", type=float, default=0.0, help="Top-p (nucleus) sampling (0: off).")
    group.add_argument("--return-log-probs", action="store_true", help="Print each generated token's log-prob.")
    group.add_argument("--stop-words", nargs="*", default=None, help="Stop at the first of these strings.")
    # Generation never trains, and reads no data: mock data stands in so the data flags are not needed.
    parser.set_defaults(skip_train=True, mock_data=True)
    return parser


def main() -> None:
    with exit_on_error():
        args = parse_and_validate_args(add_generate_args, args_defaults=GENERATE_ARGS_DEFAULTS)
        if not args.load:
            raise ValueError("--load is required: the checkpoint directory pretrain_gpt.py --save wrote")
        if args.num_tokens_to_generate < 0:
            raise ValueError(f"--num-tokens-to-generate {args.num_tokens_to_generate}: must be >= 0")
        sampling_params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            num_tokens_to_generate=args.num_tokens_to_generate,
            return_log_probs=args.return_log_probs,
            skip_prompt_log_probs=True,
            stop_words=args.stop_words or None,
            seed=args.seed,
        )
    # A pretrain_hybrid.py checkpoint (--hybrid-layer-pattern / --is-hybrid-model, given or read with
    # --use-checkpoint-args) is a HybridModel; its Mamba layers keep their states in the same engine's context.
    if args.hybrid_layer_pattern or args.is_hybrid_model:
        from pretrain_hybrid import model_provider
    else:
        from pretrain_gpt import model_provider

    initialize_megatron()
    args = get_args()
    model = get_model(model_provider, wrap_with_ddp=False)
    load_checkpoint(model, None, None, strict=True)
    max_sequence_length = min(args.inference_max_seq_length, args.max_position_embeddings)
    llm = MegatronLLM(
        model=model,
        tokenizer=get_tokenizer(),
        inference_config=InferenceConfig(
            max_sequence_length=max_sequence_length,
            block_size_tokens=min(args.inference_dynamic_batching_block_size, max_sequence_length),
            max_requests=min(args.inference_max_requests, len(args.prompts)),
            random_seed=args.seed,
        ),
    )
    with torch.inference_mode():
        requests = llm.generate(args.prompts, sampling_params)
    if torch.distributed.get_rank() == 0:
        for request in requests:
            record = {
                "prompt": request.prompt,
                "generated_text": request.generated_text,
                "generated_tokens": request.generated_tokens,
            }
            if args.return_log_probs:
                record["generated_log_probs"] = request.generated_log_probs
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    tool_main(main)
