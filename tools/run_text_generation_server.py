"""Serve a checkpoint saved by pretrain_gpt.py or pretrain_hybrid.py over HTTP: OpenAI's completions and chat API,
and Megatron's PUT /api.

    torchrun --nproc_per_node 2 tools/run_text_generation_server.py --tensor-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --load checkpoints/gpt --port 5000

The model flags are pretrain_gpt.py's (the model is built by its ``model_provider``; with ``--hybrid-layer-pattern``
it is pretrain_hybrid.py's HybridModel; ``--use-checkpoint-args`` reads them from the checkpoint instead), the
layout flags choose the TP/PP layout to serve at (any layout: the checkpoint is resharded on load), and the
inference flags size the engine: ``--inference-max-requests`` (requests decoding at once; more wait in the queue),
``--inference-max-seq-length`` (prompt plus generation, capped by ``--max-position-embeddings``),
``--inference-dynamic-batching-block-size`` / ``-buffer-size-gb`` / ``-max-tokens`` (the paged KV cache and the
tokens per step). ``--temperature``, ``--top_k`` and ``--top_p`` are
the defaults of requests that do not set them. Rank 0 listens on ``--host``:``--port``; the other ranks step the
engine with it. Needs the inference extra: ``pip install -e ".[inference]"``. See docs/inference.md.
"""

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.core import parallel_state  # noqa: E402
from megatron.core.inference.text_generation_server.validation import DEFAULT_MAX_REQUEST_BODY_BYTES  # noqa: E402
from megatron.training import get_args, get_model, get_tokenizer, print_rank_0  # noqa: E402
from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.checkpoint_args import load_args_from_checkpoint  # noqa: E402
from megatron.training.checkpointing import load_checkpoint  # noqa: E402
from megatron.training.error_handling import exit_on_error  # noqa: E402
from megatron.training.global_vars import set_args  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402


def add_text_generate_args(parser):
    """The server's own flags (Megatron's tools/run_text_generation_server.py names)."""
    group = parser.add_argument_group(title="text generation")
    group.add_argument(
        "--port",
        type=int,
        default=5000,
        help="Port the text generation server listens on (0: any free port; the start-up line names it).",
    )
    group.add_argument("--host", type=str, default="0.0.0.0", help="Address the server binds (0.0.0.0: all).")
    group.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="Sampling temperature of requests that do not give one (0: greedy).",
    )
    group.add_argument(
        "--top_k", type=int, default=0, help="Top-k sampling of requests that do not give one (0: off, 1: greedy)."
    )
    group.add_argument(
        "--top_p", type=float, default=0.0, help="Top-p (nucleus) sampling of requests that do not give one (0: off)."
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Largest request body the server reads, in bytes; a larger one is answered 413 with an OpenAI error "
        "body, before it is read when it declares its length (0: no bound). Ours: Megatron's server has no bound.",
    )
    group.add_argument(
        "--ignore-unknown-request-fields",
        action="store_true",
        help="Ignore request fields an endpoint does not know, instead of answering 400 naming the field as "
        "OpenAI's API does (for clients that send extras of their own). Ours, not Megatron's.",
    )
    group.add_argument(
        "--served-model-name",
        type=str,
        default=None,
        help="The model id clients send as 'model' (default: the name of the --load directory).",
    )
    # Serving never trains: no training length, no optimizer or RNG state to load, and a missing checkpoint is
    # an error rather than a random model.
    parser.set_defaults(skip_train=True, no_load_optim=True, no_load_rng=True, exit_on_missing_checkpoint=True)
    return parser


def parse_server_args():
    """pretrain_gpt.py's flags plus the server's, validated as a training run's would be (Megatron's
    parse_and_validate_args order: parse, --use-checkpoint-args, validate)."""
    args = parse_args(add_text_generate_args)
    if args.use_checkpoint_args:
        # The model's shape comes from the checkpoint; the layout to serve at is the command line's (the checkpoint
        # is resharded on load) unless --use-mp-args-from-checkpoint-args asks for the saved one.
        load_args_from_checkpoint(args)
    data_flags = (
        args.data_path,
        args.data_args_path,
        args.train_data_path,
        args.valid_data_path,
        args.test_data_path,
        args.per_split_data_args_path,
    )
    if all(flag is None for flag in data_flags):
        args.mock_data = True  # the server reads no dataset; the training checks want a data source named
    validate_args(args, {"micro_batch_size": 1})
    set_args(args)
    return args


def _check_serving_args(args) -> None:
    """Refuse what this server cannot do, before any collective (every rank raises the same error)."""
    if not args.load:
        raise ValueError("--load is required: the checkpoint directory to serve (saved by pretrain_gpt.py --save)")
    if not os.path.isdir(args.load):
        raise ValueError(f"--load {args.load}: no such directory")
    if args.data_parallel_size != 1:
        raise ValueError(
            f"the text generation server runs one model replica, but world size {args.world_size} = "
            f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x DP "
            f"{args.data_parallel_size}; launch TP x PP processes (or start one server per replica)"
        )
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port}: not a TCP port (1-65535, or 0 for any free one)")
    if args.max_request_body_bytes < 0:
        raise ValueError(f"--max-request-body-bytes {args.max_request_body_bytes}: need >= 0 (0: no bound)")
    if args.temperature < 0 or args.top_k < 0 or not 0.0 <= args.top_p <= 1.0:
        raise ValueError(
            f"--temperature {args.temperature} / --top_k {args.top_k} / --top_p {args.top_p}: need "
            "temperature >= 0, top_k >= 0 and 0 <= top_p <= 1"
        )
    if args.inference_max_requests < 1 or args.inference_max_seq_length < 2:
        raise ValueError(
            f"--inference-max-requests {args.inference_max_requests} / --inference-max-seq-length "
            f"{args.inference_max_seq_length}: need at least 1 request and 2 tokens"
        )
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise ValueError(f"--chat-template {args.chat_template}: no such file (give a Jinja chat template file)")


def max_sequence_length(args) -> int:
    """Prompt plus generation of one request: --inference-max-seq-length, at most what the positions cover."""
    return min(args.inference_max_seq_length, args.max_position_embeddings)


def build_engine(args, model, tokenizer):
    """The dynamic (continuous-batching) engine over the loaded model, sized by the inference flags."""
    from megatron.core.inference.contexts import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    config = model.config
    seq_length = max_sequence_length(args)
    block_size = min(args.inference_dynamic_batching_block_size, seq_length)
    # Enough blocks for every request to hold a full-length sequence, and no more than the buffer allows.
    blocks_needed = args.inference_max_requests * math.ceil(seq_length / block_size)
    element_size = torch.empty((), dtype=config.params_dtype).element_size()
    kv_heads = config.num_query_groups or config.num_attention_heads
    # Only attention layers cache keys/values (a hybrid's Mamba layers keep a fixed-size state per request slot).
    pattern = getattr(args, "hybrid_layer_pattern", None)
    attention_layers = pattern.split("/")[0].count("*") if pattern else config.num_layers
    bytes_per_block = 2 * max(attention_layers, 1) * kv_heads * config.kv_channels * element_size * block_size
    blocks_in_buffer = int(args.inference_dynamic_batching_buffer_size_gb * 1024**3 // bytes_per_block)
    context = DynamicInferenceContext(
        params_dtype=config.params_dtype,
        num_layers=config.num_layers,
        kv_channels=config.kv_channels,
        num_attention_heads=kv_heads,
        max_sequence_length=seq_length,
        block_size_tokens=block_size,
        num_blocks=max(1, min(blocks_needed, blocks_in_buffer)),
        max_requests=args.inference_max_requests,
        max_tokens=args.inference_dynamic_batching_max_tokens,
    )
    wrapper = GPTInferenceWrapper(model, inference_context=context)
    controller = TextGenerationController(wrapper, tokenizer)
    return DynamicInferenceEngine(controller, context)


def main() -> None:
    from megatron.core.inference.text_generation_server.server import (
        TextGenerationServer,
        control_group,
        listen_socket,
    )

    with exit_on_error():  # a bad flag is reported once for the job, not once per rank
        args = parse_server_args()
        _check_serving_args(args)
        # Rank 0 takes its port before anything slow (a port in use fails now, not after the checkpoint loads).
        listener = listen_socket(args.host, args.port) if args.rank == 0 else None
    from megatron.core.inference.text_generation_server.validation import ServingDefaults

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
    model = model[0]
    model.eval()
    tokenizer = get_tokenizer()
    engine = build_engine(args, model, tokenizer)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.load))
    server = TextGenerationServer(
        engine,
        tokenizer,
        model_name=name,
        max_sequence_length=max_sequence_length(args),
        defaults=ServingDefaults(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
        chat_template_file=args.chat_template,
        group=control_group(),
        vocab_size=tokenizer.vocab_size,
        max_request_body_bytes=args.max_request_body_bytes,
        ignore_unknown_fields=args.ignore_unknown_request_fields,
    )
    port = listener.getsockname()[1] if listener is not None else args.port  # the real one for --port 0
    print_rank_0(
        f"serving '{name}' from {args.load} at TP={parallel_state.get_tensor_model_parallel_world_size()} "
        f"PP={parallel_state.get_pipeline_model_parallel_world_size()} on http://{args.host}:{port}"
    )
    server.run(host=args.host, port=args.port, sock=listener)


if __name__ == "__main__":
    from megatron.training.error_handling import tool_main

    tool_main(main)
