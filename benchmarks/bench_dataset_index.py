"""GPTDataset index build time and memory on a synthetic 10^9-token corpus, and GPTDataset random-read speed.

Part 1 builds the document, sample and shuffle indices of a GPTDataset whose low-level dataset is only a list of
sequence lengths (the index builders never read tokens), for one epoch and for several, timing each step; peak
memory is measured in a second, identical build under tracemalloc (numpy reports its buffers to it). It also
times the pure-Python loop that the spec describes on a smaller corpus, for scale, and the blending greedy.
Part 2 times random `dataset[i]` reads on a real `.bin/.idx` (the built-in Shakespeare corpus, or a generated one
when it is absent) with the sample options that change the per-sample work. Prints a table and writes JSON to
benchmarks/results/.

    python benchmarks/bench_dataset_index.py [--tokens 1e9] [--mean-document-length 1000] [--sequence-length 2048]
"""

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.core.datasets import index_helpers  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from megatron.core.datasets.utils import Split  # noqa: E402
from tests.unit_tests.datasets.reference_indices import reference_gpt_indices  # noqa: E402

BUILTIN_PREFIX = REPO_ROOT / "megatron" / "training" / "builtin_data" / "shakespeare_text_document"


class Tokenizer:
    eod = 0
    pad = 0
    unique_identifiers = {"class": "BenchTokenizer"}


class LengthsOnly:
    """A low-level dataset that is only sequence lengths: enough for building indices."""

    def __init__(self, total_tokens: int, mean_length: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        count = max(1, total_tokens // mean_length)
        lengths = rng.integers(1, 2 * mean_length, size=count, dtype=np.int32)
        lengths[-1] += total_tokens - int(lengths.sum(dtype=np.int64))  # exactly total_tokens (may go <= 0)
        if lengths[-1] <= 0:
            lengths[-1] = 1
        self.sequence_lengths = lengths


def config(sequence_length: int, **overrides) -> GPTDatasetConfig:
    settings = dict(random_seed=1234, sequence_length=sequence_length, tokenizer=Tokenizer())
    settings.update(overrides)
    return GPTDatasetConfig(**settings)


def time_index_steps(lengths: np.ndarray, num_epochs: int, sequence_length: int) -> dict:
    """Time the three index steps on their own (one shared RandomState, in Megatron's order)."""
    indices = np.arange(len(lengths), dtype=np.int32)
    tokens_per_epoch = int(lengths.sum(dtype=np.int64))
    rng = np.random.RandomState(1234)
    start = time.perf_counter()
    document_index = index_helpers.build_document_index(indices, num_epochs, rng, False)
    after_documents = time.perf_counter()
    sample_index = index_helpers.build_sample_index(
        lengths, document_index, sequence_length, num_epochs, tokens_per_epoch
    )
    after_samples = time.perf_counter()
    total = sample_index.shape[0] - 1
    shuffle_index = index_helpers.build_shuffle_index(total, total, rng)
    after_shuffle = time.perf_counter()
    return {
        "document_index_s": after_documents - start,
        "sample_index_s": after_samples - after_documents,
        "shuffle_index_s": after_shuffle - after_samples,
        "samples": total,
        "index_mb": (document_index.nbytes + sample_index.nbytes + shuffle_index.nbytes) / 2**20,
    }


def build_dataset(low_level: LengthsOnly, num_samples, sequence_length: int) -> GPTDataset:
    indices = np.arange(len(low_level.sequence_lengths), dtype=np.int32)
    return GPTDataset(low_level, None, indices, num_samples, Split.train, config(sequence_length))


def bench_index_build(total_tokens: int, mean_length: int, sequence_length: int, epochs: int) -> dict:
    low_level = LengthsOnly(total_tokens, mean_length)
    num_samples = None if epochs == 1 else (epochs * total_tokens - 1) // sequence_length - 10
    start = time.perf_counter()
    dataset = build_dataset(low_level, num_samples, sequence_length)
    total_s = time.perf_counter() - start
    num_epochs = int(dataset.document_index.shape[0] // len(low_level.sequence_lengths))
    del dataset
    tracemalloc.start()
    dataset = build_dataset(low_level, num_samples, sequence_length)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    steps = time_index_steps(low_level.sequence_lengths, num_epochs, sequence_length)
    return {
        "case": f"{total_tokens:.0e} tokens, {num_epochs} epoch(s)",
        "tokens": total_tokens,
        "documents": len(low_level.sequence_lengths),
        "epochs": num_epochs,
        "sequence_length": sequence_length,
        "gpt_dataset_build_s": total_s,
        "peak_traced_mb": peak / 2**20,
        **steps,
        "len": len(dataset),
    }


def bench_reference_loop(total_tokens: int, mean_length: int, sequence_length: int) -> dict:
    """The spec's plain-Python loops, for scale."""
    low_level = LengthsOnly(total_tokens, mean_length)
    lengths = low_level.sequence_lengths
    start = time.perf_counter()
    reference_gpt_indices(lengths, range(len(lengths)), None, sequence_length, 1, 1234)
    loop_s = time.perf_counter() - start
    start = time.perf_counter()
    build_dataset(low_level, None, sequence_length)
    return {"tokens": total_tokens, "python_loop_s": loop_s, "numpy_s": time.perf_counter() - start}


def bench_blending(size: int, weights) -> dict:
    start = time.perf_counter()
    index_helpers.build_blending_indices(weights, size)
    elapsed = time.perf_counter() - start
    return {"samples": size, "datasets": len(weights), "seconds": elapsed, "us_per_sample": 1e6 * elapsed / size}


def real_corpus(directory: str) -> str:
    """The built-in corpus when present, else 2M generated tokens in 2000 documents."""
    if IndexedDataset.exists(str(BUILTIN_PREFIX)):
        return str(BUILTIN_PREFIX)
    prefix = os.path.join(directory, "generated")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for _ in range(2000):
        tokens = np.append(rng.integers(1, 8000, int(rng.integers(10, 2000))), 0)
        builder.add_document(tokens, [len(tokens)])
    builder.finalize(get_idx_path(prefix))
    return prefix


def bench_reads(prefix: str, cache: str, sequence_length: int, reads: int, label: str, **options) -> dict:
    """Random `dataset[i]` reads on one thread, as in a DataLoader worker (PyTorch gives each one thread)."""
    torch.set_num_threads(1)
    low_level = IndexedDataset(prefix)
    indices = np.arange(len(low_level), dtype=np.int32)
    cfg = config(sequence_length, blend=([prefix], None), split="1", path_to_cache=cache, **options)
    dataset = GPTDataset(low_level, prefix, indices, 4 * reads, Split.train, cfg)
    order = np.random.default_rng(0).integers(0, len(dataset), reads)
    dataset[int(order[0])]
    start = time.perf_counter()
    for idx in order:
        dataset[int(idx)]
    elapsed = time.perf_counter() - start
    return {"options": label, "sequence_length": sequence_length, "reads": reads, "reads_per_s": reads / elapsed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--mean-document-length", type=int, default=1000)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--reference-tokens", type=float, default=None, help="default: --tokens")
    parser.add_argument("--blend-samples", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=5000)
    parser.add_argument("--read-sequence-length", type=int, default=1024)
    args = parser.parse_args()

    builds = [
        bench_index_build(int(args.tokens), args.mean_document_length, args.sequence_length, epochs)
        for epochs in args.epochs
    ]
    reference_tokens = int(args.reference_tokens or args.tokens)
    reference = bench_reference_loop(reference_tokens, args.mean_document_length, args.sequence_length)
    blends = [bench_blending(args.blend_samples, w) for w in ([0.3, 0.7], [0.2, 0.3, 0.5], [0.125] * 8)]
    with tempfile.TemporaryDirectory() as directory:
        prefix = real_corpus(directory)
        cache = os.path.join(directory, "cache")
        length = args.read_sequence_length
        reads = [
            bench_reads(prefix, cache, length, args.reads, "defaults (cached causal mask)"),
            bench_reads(prefix, cache, length, args.reads, "no attention mask", create_attention_mask=False),
            bench_reads(
                prefix,
                cache,
                length,
                args.reads,
                "reset positions + mask, eod loss mask",
                reset_position_ids=True,
                reset_attention_mask=True,
                eod_mask_loss=True,
            ),
        ]

    print(f"\nGPTDataset index build (synthetic lengths, mean document {args.mean_document_length} tokens)")
    print(
        f"{'case':<28}{'docs':>10}{'samples':>11}{'doc idx s':>11}{'sample idx s':>14}{'shuffle s':>11}"
        f"{'total s':>9}{'peak MB':>9}{'index MB':>10}"
    )
    for row in builds:
        print(
            f"{row['case']:<28}{row['documents']:>10}{row['samples']:>11}{row['document_index_s']:>11.2f}"
            f"{row['sample_index_s']:>14.2f}{row['shuffle_index_s']:>11.2f}{row['gpt_dataset_build_s']:>9.2f}"
            f"{row['peak_traced_mb']:>9.0f}{row['index_mb']:>10.0f}"
        )
    print(
        f"\nspec's Python loop on {reference['tokens']:.0e} tokens: {reference['python_loop_s']:.2f} s; "
        f"numpy GPTDataset build: {reference['numpy_s']:.3f} s"
    )
    print("\nblending greedy (Python loop)")
    for row in blends:
        print(
            f"  {row['datasets']} datasets, {row['samples']} samples: {row['seconds']:.2f} s "
            f"({row['us_per_sample']:.2f} us/sample)"
        )
    print(f"\nGPTDataset random reads on {prefix}")
    for row in reads:
        print(f"  {row['options']:<40} S={row['sequence_length']}: {row['reads_per_s']:>8.0f} samples/s")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nprocess peak RSS (includes torch): {peak_rss_mb:.0f} MB")

    results_dir = REPO_ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    output = results_dir / "bench_dataset_index.json"
    output.write_text(
        json.dumps(
            {
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "index_build": builds,
                "reference_loop": reference,
                "blending": blends,
                "reads": reads,
                "peak_rss_mb": peak_rss_mb,
            },
            indent=2,
        )
    )
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
