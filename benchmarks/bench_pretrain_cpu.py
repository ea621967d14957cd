"""End-to-end training throughput on CPU: pretrain_gpt.py at TP1PP1, TP2, PP2 and DP2 next to a plain PyTorch loop.

Every run trains the same GPT (4 layers, hidden 256, 8 heads, seq 256, tied 8192-token vocabulary, no dropout) on
the built-in corpus with the same global batch (16 sequences of 256 tokens in micro-batches of 4: four per step on
one data-parallel rank, two on each at DP2) and AdamW + cosine LR + clipping at 1.0. The plain loop below is
single-process PyTorch written for this comparison (no megatron imports in the loop): it reads random windows of
the same tokenized corpus, accumulates gradients over the same micro-batches, clips, steps AdamW and its LR
schedule.

A run's step time comes from pretrain_gpt.py's log line: "elapsed time per iteration" over each logging interval
after the first (start-up and warm-up excluded), i.e. everything in the training loop: data, forward, backward,
gradient reduction, optimizer, logging. The plain loop is timed the same way (blocks of --log-interval steps, the
first dropped). All runs share the machine's cores: one rank gets them all, two ranks get half each. The whole
sequence of runs is repeated (--repeats) so that load from other processes on a shared machine hits every run
alike; the table shows the median and the fastest block of each run over all repeats, and the ratio to the plain
loop is given for both.

TFLOP/s counts Megatron's model FLOPs (megatron/training/flops.py, causal attention halved) over the whole CPU;
MFU divides by the fp32 matmul peak measured on all cores (`measured_cpu_matmul_peak_flops`). Target: TP1PP1 step
time <= 1.05 x the plain loop's.

    python benchmarks/bench_pretrain_cpu.py [--iters 20 --log-interval 5 --repeats 2 --layouts tp1pp1,tp2,pp2,dp2]
"""

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the functional tests' torchrun launcher and log parser

from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding  # noqa: E402
from megatron.training import builtin_data  # noqa: E402
from megatron.training.arguments import parse_args_list, validate_args  # noqa: E402
from megatron.training.flops import measured_cpu_matmul_peak_flops, num_floating_point_operations  # noqa: E402
from tests.functional_tests.harness import CPU_FLAGS, builtin_data_flags, run_pretrain  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 4, 256, 8, 256, 8192
MICRO_BATCH, GLOBAL_BATCH = 4, 16
LR, MIN_LR, WARMUP_ITERS, WEIGHT_DECAY, CLIP = 3e-4, 3e-5, 2, 0.01, 1.0

MODEL_FLAGS = [
    "--num-layers",
    str(LAYERS),
    "--hidden-size",
    str(HIDDEN),
    "--num-attention-heads",
    str(HEADS),
    "--seq-length",
    str(SEQ),
    "--max-position-embeddings",
    str(SEQ),
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--micro-batch-size",
    str(MICRO_BATCH),
    "--global-batch-size",
    str(GLOBAL_BATCH),
    "--lr",
    str(LR),
    "--min-lr",
    str(MIN_LR),
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    str(WARMUP_ITERS),
    "--weight-decay",
    str(WEIGHT_DECAY),
    "--clip-grad",
    str(CLIP),
    "--eval-iters",
    "0",
]
LAYOUTS = {
    "tp1pp1": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
}


# ---- the plain PyTorch loop --------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention (SDPA) and a GELU MLP, biases on."""

    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):  # [batch, seq, hidden]
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, HIDDEN))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PlainGPT(torch.nn.Module):
    """GPT-2-style: learned positions, final LayerNorm, output layer tied to the word embedding."""

    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.positions = torch.nn.Embedding(SEQ, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(HIDDEN)
        # GPT-2's initialisation, as Megatron's: N(0, 0.02), the residual-branch outputs scaled by 1/sqrt(2 layers),
        # zero biases. (PyTorch's N(0, 1) embeddings would saturate the tied softmax, whose underflowing gradients
        # then run on the CPU's slow denormal path.)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.zeros_(param)
            elif param.ndim > 1:
                std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith(("out.weight", "down.weight")) else 0.02
                torch.nn.init.normal_(param, std=std)

    def forward(self, tokens, labels):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.tokens.weight.t()
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def plain_training_step_times(iters: int, log_interval: int) -> list:
    """Per-step seconds (block means of `log_interval` steps) of a plain single-process training loop."""
    torch.manual_seed(1234)
    corpus = np.memmap(builtin_data.data_prefix() + ".bin", dtype=np.uint16, mode="r")
    model = PlainGPT()
    no_decay = [p for name, p in model.named_parameters() if p.ndim == 1]
    decay = [p for name, p in model.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}], lr=LR
    )

    def lr_factor(step):  # linear warm-up, cosine decay to MIN_LR over the run
        if step < WARMUP_ITERS:
            return (step + 1) / WARMUP_ITERS
        progress = (step - WARMUP_ITERS) / max(1, iters - WARMUP_ITERS)
        return (MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))) / LR

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    micro_batches = GLOBAL_BATCH // MICRO_BATCH
    block_times, block_start = [], time.perf_counter()
    for step in range(iters):
        for _ in range(micro_batches):
            starts = np.random.randint(0, len(corpus) - SEQ - 1, size=MICRO_BATCH)
            window = torch.from_numpy(np.stack([corpus[s : s + SEQ + 1] for s in starts]).astype(np.int64))
            loss = model(window[:, :-1], window[:, 1:]) / micro_batches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % log_interval == 0:
            loss.item()  # the host sync a logging step does
            block_times.append((time.perf_counter() - block_start) / log_interval)
            block_start = time.perf_counter()
    return block_times


# ---- pretrain_gpt.py runs ----------------------------------------------------------------------------------------


def pretrain_step_times(layout_flags, nproc, threads_per_rank, iters, log_interval, cache_dir) -> list:
    flags = (
        MODEL_FLAGS
        + layout_flags
        + CPU_FLAGS
        + builtin_data_flags(cache_dir)
        + [
            "--train-iters",
            str(iters),
            "--log-interval",
            str(log_interval),
        ]
    )
    result = run_pretrain(flags, nproc, timeout=1800, threads_per_rank=threads_per_rank)
    return [ms / 1000.0 for ms in result.curve("elapsed time per iteration (ms)").values()]


def flops_per_iteration() -> float:
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        args = validate_args(parse_args_list(MODEL_FLAGS + CPU_FLAGS + builtin_data_flags() + ["--train-iters", "1"]))
    args.padded_vocab_size = vocab_size_with_padding(VOCAB, args, logging_enabled=False)
    return num_floating_point_operations(args, GLOBAL_BATCH)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="training iterations per run")
    parser.add_argument("--log-interval", type=int, default=5, help="iterations per timed block")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {list(LAYOUTS)}")
    parser.add_argument("--repeats", type=int, default=2, help="times the whole sequence of runs is repeated")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="cores the runs share")
    options = parser.parse_args()
    if options.iters < 2 * options.log_interval:
        parser.error("--iters must cover at least two --log-interval blocks (the first is dropped as warm-up)")

    torch.set_num_threads(options.cores)
    peak = measured_cpu_matmul_peak_flops()
    flops = flops_per_iteration()
    tokens_per_iteration = GLOBAL_BATCH * SEQ

    plain = "plain PyTorch loop"
    runs = {plain: (1, options.cores)}
    for name in options.layouts.split(","):
        nproc, _ = LAYOUTS[name]
        runs[f"pretrain_gpt.py {name}"] = (nproc, max(1, options.cores // nproc))
    blocks = {run: [] for run in runs}  # per-step seconds of every timed block, warm-up blocks dropped
    with tempfile.TemporaryDirectory() as cache_dir:
        for _ in range(options.repeats):
            blocks[plain] += plain_training_step_times(options.iters, options.log_interval)[1:]
            for name in options.layouts.split(","):
                nproc, layout_flags = LAYOUTS[name]
                run = f"pretrain_gpt.py {name}"
                times = pretrain_step_times(
                    layout_flags, nproc, runs[run][1], options.iters, options.log_interval, cache_dir
                )
                blocks[run] += times[1:]

    print(
        f"\nGPT {LAYERS}L h{HIDDEN} {HEADS}heads seq{SEQ} vocab{VOCAB}, global batch {GLOBAL_BATCH} "
        f"(micro-batch {MICRO_BATCH}), fp32, {options.cores} cores; {options.repeats} x {options.iters} iterations "
        f"per run, first {options.log_interval} of each dropped; model FLOPs/iteration {flops / 1e9:.1f} G; "
        f"measured CPU fp32 matmul peak {peak / 1e12:.3f} TFLOP/s"
    )
    header = (
        f"{'run':24s} {'ranks':>5s} {'thr/rank':>8s} {'median ms':>9s} {'best ms':>8s} {'tokens/s':>8s} "
        f"{'TFLOP/s':>8s} {'MFU':>6s} {'vs plain (median, best)':>24s}"
    )
    print(header)
    print("-" * len(header))
    table = {}
    for run, (nproc, threads) in runs.items():
        median, best = statistics.median(blocks[run]), min(blocks[run])
        table[run] = {
            "ranks": nproc,
            "threads_per_rank": threads,
            "median_step_s": median,
            "best_step_s": best,
            "block_step_s": blocks[run],
            "tokens_per_s": tokens_per_iteration / median,
            "tflops": flops / median / 1e12,
            "mfu": flops / median / peak,
            "vs_plain_median": median / statistics.median(blocks[plain]),
            "vs_plain_best": best / min(blocks[plain]),
        }
        row = table[run]
        print(
            f"{run:24s} {nproc:5d} {threads:8d} {median * 1000:9.1f} {best * 1000:8.1f} {row['tokens_per_s']:8.0f} "
            f"{row['tflops']:8.4f} {row['mfu']:6.1%} {row['vs_plain_median']:15.3f}x {row['vs_plain_best']:6.3f}x"
        )
    print("tokens/s, TFLOP/s and MFU are for the whole CPU, at the median step time")
    if "pretrain_gpt.py tp1pp1" in table:
        row = table["pretrain_gpt.py tp1pp1"]
        met = max(row["vs_plain_median"], row["vs_plain_best"]) <= 1.05
        print(
            f"TP1PP1 / plain loop step time: {row['vs_plain_median']:.3f} (median), {row['vs_plain_best']:.3f} "
            f"(best); target <= 1.05: {'met' if met else 'NOT met'}"
        )
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "bench_pretrain_cpu.json").write_text(
        json.dumps(
            {"options": vars(options), "flops_per_iteration": flops, "cpu_matmul_peak_flops": peak, "runs": table},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
