"""Preprocessing throughput and memory of tools/preprocess_data.py, and IndexedDataset random-read speed.

Generates a JSON-lines file of `--size-mb` MB (the built-in Shakespeare scenes, repeated, or synthetic words when
the corpus is absent) in a temporary directory, trains a small GPT-2 byte-level BPE on its first documents, then
runs `tools/preprocess_data.py --append-eod` with each `--workers` value, sampling the memory of the tool and all
its worker processes every 50 ms (RSS summed, and PSS, which counts pages shared by the forked workers once).
Finally it times random reads on the result: whole sequences (`ds[i]`) and GPT-style samples
(`ds.get(i, offset, length)`), with mmap on and off. Prints a table and writes JSON to benchmarks/results/.

    python benchmarks/bench_preprocess.py [--size-mb 200] [--workers 1 2] [--vocab-size 4096] [--reads 200000]
"""

import argparse
import gzip
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

BUILTIN_CORPUS = REPO_ROOT / "megatron" / "training" / "builtin_data" / "shakespeare.jsonl.gz"


def source_texts():
    """Real text when the built-in corpus is there, else seeded synthetic sentences."""
    if BUILTIN_CORPUS.is_file():
        with gzip.open(BUILTIN_CORPUS, "rt", encoding="utf-8") as lines:
            return [json.loads(line)["text"] for line in lines if line.strip()]
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgkjqxz") for _ in range(rng.randint(1, 9))) for _ in range(5000)]
    return [" ".join(rng.choice(words) for _ in range(1000)) + "." for _ in range(500)]


def write_corpus(path: Path, size_mb: float) -> int:
    """Write JSON lines until `size_mb` MB; returns the number of documents."""
    texts, target, written, count = source_texts(), size_mb * 1e6, 0, 0
    with open(path, "w", encoding="utf-8") as file:
        while written < target:
            line = json.dumps({"text": f"[{count}] " + texts[count % len(texts)]}) + "\n"
            file.write(line)
            written += len(line.encode("utf-8"))
            count += 1
    return count


def train_tokenizer(corpus: Path, directory: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(corpus, encoding="utf-8") as file:
        sample = [json.loads(next(file))["text"] for _ in range(500)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sample, trainer=trainer)
    directory.mkdir(exist_ok=True)
    return tokenizer.model.save(str(directory))


def _children_of():
    """Parent pid -> child pids, from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                stat = file.read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry))
    return children


def _tree_memory_kb(root: int):
    """(sum of RSS, sum of PSS) in kB over `root` and all its descendants."""
    children, stack, rss, pss = _children_of(), [root], 0, 0
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as file:
                for line in file:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:
            continue
    return rss, pss


def run_preprocess(corpus: Path, prefix: Path, vocab_file, merge_file, workers: int):
    command = [
        sys.executable,
        str(REPO_ROOT / "tools" / "preprocess_data.py"),
        "--input",
        str(corpus),
        "--output-prefix",
        str(prefix),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab_file,
        "--merge-file",
        merge_file,
        "--append-eod",
        "--workers",
        str(workers),
        "--log-interval",
        "100000",
    ]
    peak = {"rss": 0, "pss": 0}
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def sample():
        while process.poll() is None:
            rss, pss = _tree_memory_kb(process.pid)
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, stderr = process.communicate()
    elapsed = time.perf_counter() - started
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"preprocess_data.py failed:\n{stderr}")
    return elapsed, peak["rss"] / 1024, peak["pss"] / 1024


def time_random_reads(prefix: str, reads: int, use_mmap: bool, sample_length: int = 2049):
    dataset = IndexedDataset(prefix, mmap=use_mmap)
    rng = np.random.default_rng(0)
    indices = rng.integers(0, len(dataset), size=reads)
    lengths = dataset.sequence_lengths
    started = time.perf_counter()
    for i in indices:
        dataset[int(i)]
    whole = reads / (time.perf_counter() - started)
    offsets = (rng.random(reads) * np.maximum(lengths[indices] - sample_length, 0)).astype(np.int64)
    started = time.perf_counter()
    for i, offset in zip(indices, offsets):
        dataset.get(int(i), int(offset), int(min(sample_length, lengths[i] - offset)))
    samples = reads / (time.perf_counter() - started)
    return whole, samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=200.0, help="size of the generated JSON-lines input")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to measure")
    parser.add_argument("--vocab-size", type=int, default=4096, help="size of the BPE trained on the fly")
    parser.add_argument("--reads", type=int, default=200_000, help="random reads per read measurement")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "bench_preprocess.json")
    args = parser.parse_args()

    results = {
        "size_mb": args.size_mb,
        "vocab_size": args.vocab_size,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "preprocess": [],
        "random_reads": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        documents = write_corpus(corpus, args.size_mb)
        input_mb = corpus.stat().st_size / 1e6
        vocab_file, merge_file = train_tokenizer(corpus, tmp / "tokenizer", args.vocab_size)
        print(f"input: {input_mb:.1f} MB, {documents} documents; GPT-2 BPE with {args.vocab_size} tokens")

        prefix = None
        for workers in args.workers:
            prefix = tmp / f"out_w{workers}"
            elapsed, peak_rss, peak_pss = run_preprocess(corpus, prefix, vocab_file, merge_file, workers)
            tokens = int(IndexedDataset(f"{prefix}_text_document").sequence_lengths.sum(dtype=np.int64))
            results["preprocess"].append(
                {
                    "workers": workers,
                    "seconds": elapsed,
                    "mb_per_s": input_mb / elapsed,
                    "tokens": tokens,
                    "tokens_per_s": tokens / elapsed,
                    "peak_rss_mb": peak_rss,
                    "peak_pss_mb": peak_pss,
                }
            )
        for use_mmap in (True, False):
            whole, samples = time_random_reads(f"{prefix}_text_document", args.reads, use_mmap)
            results["random_reads"].append(
                {"mmap": use_mmap, "sequence_reads_per_s": whole, "sample_reads_per_s": samples}
            )

    print(
        f"\n{'workers':>7} | {'seconds':>8} | {'MB/s':>6} | {'tokens':>11} | {'tokens/s':>9} | "
        f"{'peak RSS MB':>11} | {'peak PSS MB':>11}"
    )
    for row in results["preprocess"]:
        print(
            f"{row['workers']:>7} | {row['seconds']:>8.1f} | {row['mb_per_s']:>6.2f} | {row['tokens']:>11,} | "
            f"{row['tokens_per_s']:>9,.0f} | {row['peak_rss_mb']:>11.0f} | {row['peak_pss_mb']:>11.0f}"
        )
    print(f"\n{'mmap':>5} | {'ds[i] reads/s':>13} | {'get(i, offset, 2049) reads/s':>28}")
    for row in results["random_reads"]:
        print(f"{str(row['mmap']):>5} | {row['sequence_reads_per_s']:>13,.0f} | {row['sample_reads_per_s']:>28,.0f}")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
