"""Convert checkpoints between Hugging Face and Megatron (Megatron-LM's ``tools/checkpoint/convert.py`` interface).

HF -> Megatron training checkpoint (torch_dist; fine-tune it with ``pretrain_gpt.py --load OUT --finetune
--use-checkpoint-args``)::

    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver core --load-dir HF_DIR --save-dir OUT \\
        [--target-tensor-parallel-size N] [--target-pipeline-parallel-size M]

Megatron checkpoint -> HF (``config.json``, ``model.safetensors`` or shards + index, the tokenizer files)::

    python tools/checkpoint/convert.py --model-type GPT --loader core --saver hf --load-dir OUT --save-dir HF_OUT

NemotronH (``NemotronHForCausalLM``, a Mamba hybrid) converts with ``--model-type hybrid`` the same way, and
fine-tunes with ``pretrain_hybrid.py --load OUT --finetune --use-checkpoint-args``.

Tensors are streamed (memory-mapped safetensors in, one tensor at a time out), so memory stays near the largest
tensor. Unsupported models are refused with the reason before anything is written. ``HF_DIR`` is a local
directory; nothing is ever downloaded. Families: docs/huggingface.md.
"""

import argparse
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

LOADERS = ("hf", "core")
SAVERS = ("core", "hf")
# Megatron-LM's names for the Megatron-Core loader/saver and the HF family loaders, accepted as aliases.
ALIASES = {"mcore": "core", "megatron": "core", "llama_mistral": "hf", "llama2_hf": "hf"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Megatron checkpoint converter (Hugging Face <-> Megatron-Core)", allow_abbrev=False
    )
    parser.add_argument(
        "--model-type", type=str, required=True, choices=["GPT", "BERT", "hybrid"], help="Type of the model."
    )
    parser.add_argument("--loader", type=str, default="core", help=f"Format to read: {', '.join(LOADERS)}.")
    parser.add_argument("--saver", type=str, default="core", help=f"Format to write: {', '.join(SAVERS)}.")
    parser.add_argument("--load-dir", type=str, required=True, help="Directory to load the checkpoint from.")
    parser.add_argument("--save-dir", type=str, required=True, help="Directory to save the checkpoint to.")
    parser.add_argument(
        "--max-queue-size",
        type=int,
        default=50,
        help="Accepted for Megatron-LM compatibility (this converter streams in one process).",
    )
    parser.add_argument(
        "--no-checking",
        action="store_false",
        dest="checking",
        help="Accepted for Megatron-LM compatibility (tensors are always accounted for).",
    )
    saver = parser.add_argument_group("core saver")
    saver.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        default=1,
        help="Tensor-parallel size the checkpoint's args record (the stored tensors reshard on load).",
    )
    saver.add_argument(
        "--target-pipeline-parallel-size",
        type=int,
        default=1,
        help="Pipeline-parallel size the checkpoint's args record.",
    )
    saver.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this times the target TP size, as Megatron does.",
    )
    hf = parser.add_argument_group("hf saver")
    hf.add_argument(
        "--max-shard-size",
        type=str,
        default="5GB",
        help="Largest safetensors file; above it the weights are sharded with an index (e.g. 5GB).",
    )
    hf.add_argument(
        "--true-vocab-size",
        type=int,
        default=None,
        help="Vocabulary without Megatron's padding (default: recorded by the conversion, else the "
        "checkpoint's tokenizer's).",
    )
    hf.add_argument(
        "--hf-architecture",
        type=str,
        default=None,
        help="HF architecture to export as (default: the one the checkpoint was converted from, else "
        "inferred: GPT2LMHeadModel, LlamaForCausalLM or Qwen2ForCausalLM; NemotronHForCausalLM for a hybrid).",
    )
    return parser


def check_args(args) -> None:
    """Refuse bad combinations before anything is read or written."""
    args.loader = ALIASES.get(args.loader, args.loader)
    args.saver = ALIASES.get(args.saver, args.saver)
    if args.model_type not in ("GPT", "hybrid"):
        raise ValueError(f"--model-type {args.model_type}: only GPT and hybrid models convert")
    if (args.loader, args.saver) not in (("hf", "core"), ("core", "hf")):
        raise ValueError(
            f"--loader {args.loader} --saver {args.saver}: supported are --loader hf --saver core and "
            "--loader core --saver hf"
        )
    if not os.path.isdir(args.load_dir):
        raise ValueError(f"--load-dir {args.load_dir}: no such directory (only local directories are read)")
    if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
        raise ValueError(f"--save-dir {args.save_dir} is --load-dir; write the conversion somewhere else")


def return_freed_tensors_to_the_os() -> None:
    """Allocate every block of 1 MiB or more with mmap. glibc serves blocks below its mmap threshold (which grows to
    32 MiB) from the heap, where a stream of freed tensors of varying sizes fragments it and the memory is never
    returned; mmapped blocks go back to the OS when freed, so memory follows the tensor in flight (measured in
    benchmarks/bench_hf_conversion.py). Nothing happens with another C library."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def convert(args) -> None:
    from megatron.core.models.huggingface import export_megatron_checkpoint_to_hf, save_megatron_checkpoint_from_hf
    from megatron.core.models.huggingface.weights import parse_size

    if args.saver == "core":
        written = save_megatron_checkpoint_from_hf(
            args.load_dir,
            args.save_dir,
            args.target_tensor_parallel_size,
            args.target_pipeline_parallel_size,
            args.make_vocab_size_divisible_by,
            model_type=args.model_type,
        )
        print(
            f"wrote Megatron checkpoint {written} (args: TP {args.target_tensor_parallel_size}, "
            f"PP {args.target_pipeline_parallel_size})"
        )
    else:
        files = export_megatron_checkpoint_to_hf(
            args.load_dir,
            args.save_dir,
            parse_size(args.max_shard_size),
            args.hf_architecture,
            args.true_vocab_size,
            model_type=args.model_type,
        )
        print(f"wrote Hugging Face model {args.save_dir}: {', '.join(files)}")


def main(argv=None) -> int:
    """Convert as the flags say; bad input raises an error naming the flag or file (``tool_main`` prints it)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    check_args(args)
    convert(args)  # a damaged safetensors input is named by the reader's header check (validate_safetensors_header)
    print(f"conversion took {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    from megatron.training.error_handling import tool_main

    return_freed_tensors_to_the_os()
    tool_main(main)
