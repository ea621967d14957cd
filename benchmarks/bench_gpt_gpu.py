"""Training throughput of a ~1.3B GPT in bf16 through our pretrain_gpt.py, at TP1 and TP2: tokens/s and MFU.

Run by benchmarks/gpu_check.sh on a CUDA machine. Each layout is one ``torchrun`` of pretrain_gpt.py with Megatron-LM's
flags (24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304, micro-batch 4, global batch 32, bf16, the fusions at
Megatron-LM's defaults, mock data); the step time and TFLOP/s per GPU are read from its iteration log lines, the
first log interval dropped as warm-up. A layout needing more GPUs than are visible is reported as skipped.

MFU is given against two peaks: the spec sheet's dense bf16 figure for the GPU (H100 / H200: 989 TFLOP/s) and the
bf16 matmul rate measured here (an 8192^3 torch.matmul); ``--peak-tflops`` overrides the first.

    python benchmarks/bench_gpt_gpu.py [--tp 1,2] [--out DIR]
    python benchmarks/bench_gpt_gpu.py --cpu-smoke   # tiny model, gloo on CPU: checks the flags and the parsing

Also times our Triton gradient-accumulation GEMM (``main_grad += dY^T X``) against PyTorch's on the model's shapes.
Writes ``gpt_throughput.json`` and one log per layout to ``--out``.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Dense bf16 TFLOP/s from the vendor's spec sheets (without sparsity), by a name fragment of the device.
SPEC_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0}

MODEL_1P3B = dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=50304, micro_batch=4, global_batch=32, iters=20)
MODEL_SMOKE = dict(layers=2, hidden=64, heads=4, seq=64, vocab=256, micro_batch=2, global_batch=4, iters=6)

_LOG_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([\d.]+) "
    r"\| throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)"
)


def pretrain_flags(model: dict, tp: int, cpu: bool) -> list:
    """pretrain_gpt.py's flags for ``model`` at tensor-parallel size ``tp`` (sequence parallel with TP > 1)."""
    flags = [
        f"--num-layers={model['layers']}",
        f"--hidden-size={model['hidden']}",
        f"--num-attention-heads={model['heads']}",
        f"--seq-length={model['seq']}",
        f"--max-position-embeddings={model['seq']}",
        f"--micro-batch-size={model['micro_batch']}",
        f"--global-batch-size={model['global_batch']}",
        f"--train-iters={model['iters']}",
        f"--vocab-size={model['vocab']}",
        f"--tensor-model-parallel-size={tp}",
        "--mock-data",
        "--tokenizer-type=NullTokenizer",
        "--lr=1e-4",
        f"--log-interval={max(1, model['iters'] // 4)}",
        "--eval-iters=0",
        "--log-throughput",
        "--use-distributed-optimizer",
    ]
    if tp > 1:
        flags.append("--sequence-parallel")
    flags += ["--distributed-backend=gloo"] if cpu else ["--bf16", "--distributed-backend=nccl"]
    return flags


def parse_log(text: str, global_batch: int, seq: int) -> dict | None:
    """Median step time, tokens/s and TFLOP/s per GPU over the logged intervals after the first (warm-up)."""
    rows = [(int(it), float(ms), float(tflops)) for it, ms, tflops in _LOG_LINE.findall(text)][1:]
    if not rows:
        return None
    step_ms = statistics.median(ms for _, ms, _ in rows)
    return {
        "step_ms": step_ms,
        "tokens_per_s": global_batch * seq / (step_ms / 1e3),
        "tflops_per_gpu": statistics.median(t for _, _, t in rows),
        "intervals": len(rows),
    }


def plan(tps: list, gpus: int, cpu: bool) -> list:
    """``(tp, reason to skip or None)`` per layout: a layout needs ``tp`` GPUs (on CPU, ``tp`` gloo processes)."""
    return [(tp, None if cpu or tp <= gpus else f"needs {tp} GPUs, {gpus} visible") for tp in tps]


def spec_peak(device_name: str) -> float | None:
    return next((peak for key, peak in SPEC_PEAK_TFLOPS.items() if key in device_name), None)


def measured_matmul_tflops() -> float:
    """bf16 rate of an 8192^3 matmul, the mean of 10 after 3 warm-ups."""
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - start) / 1e12


def wgrad_kernel_timing(model: dict) -> dict:
    """ms per ``main_grad += dY^T X`` (bf16 dY, X; fp32 main_grad) for the MLP's first weight on a micro-batch:
    our Triton kernel vs PyTorch (bf16 GEMM, then an add into main_grad, as without the fusion)."""
    import torch

    from megatron.core.fusions.kernels.wgrad import wgrad_accumulate

    tokens, hidden = model["micro_batch"] * model["seq"], model["hidden"]
    dy = torch.randn(tokens, 4 * hidden, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.zeros(4 * hidden, hidden, device="cuda")
    bodies = {"triton": lambda: wgrad_accumulate(dy, x, main_grad), "torch": lambda: main_grad.add_(dy.t() @ x)}
    result = {}
    for name, body in bodies.items():
        for _ in range(3):
            body()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            body()
        torch.cuda.synchronize()
        result[f"{name}_ms"] = (time.perf_counter() - start) / 20 * 1e3
    result["shape"] = [tokens, 4 * hidden, hidden]
    return result


def _text(output) -> str:
    # TimeoutExpired carries bytes even under text=True.
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def run_layout(model: dict, tp: int, cpu: bool, out: Path, timeout: int) -> dict:
    """One torchrun of pretrain_gpt.py; its log goes to ``out/tp<tp>.log``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}"]
    command += [str(REPO_ROOT / "pretrain_gpt.py"), *pretrain_flags(model, tp, cpu)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))}
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO_ROOT)
        text, status = done.stdout + done.stderr, f"exit {done.returncode}"
    except subprocess.TimeoutExpired as error:  # keep what it logged: the intervals before the limit still count
        text, status = _text(error.stdout) + _text(error.stderr), f"timed out after {timeout} s"
    (out / f"tp{tp}.log").write_text(text)
    numbers = parse_log(text, model["global_batch"], model["seq"])
    return {"status": status, "wall_s": round(time.perf_counter() - start, 1), **(numbers or {})}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes to time, comma-separated")
    parser.add_argument("--out", default=os.environ.get("OUT", str(REPO_ROOT / "benchmarks" / "results")))
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on CPU with gloo")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s per GPU for MFU")
    parser.add_argument("--timeout", type=int, default=200, help="seconds per layout")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = MODEL_SMOKE if args.cpu_smoke else MODEL_1P3B
    report = {"model": model, "layouts": {}}
    gpus = 0
    if not args.cpu_smoke:
        import torch

        gpus = torch.cuda.device_count()
        name = torch.cuda.get_device_name() if gpus else "no CUDA device"
        report |= {"device": name, "gpus": gpus}
        if gpus:
            report["peak_spec_tflops"] = args.peak_tflops or spec_peak(name)
            report["peak_measured_tflops"] = round(measured_matmul_tflops(), 1)
            report["wgrad_accum"] = wgrad_kernel_timing(model)
            print(
                f"{name}: peak bf16 {report['peak_spec_tflops']} TFLOP/s (spec), "
                f"{report['peak_measured_tflops']} measured (8192^3 matmul)",
                flush=True,
            )
            print(f"wgrad accumulation {report['wgrad_accum']}", flush=True)
    for tp, skip in plan([int(tp) for tp in args.tp.split(",")], gpus, args.cpu_smoke):
        if skip:
            report["layouts"][f"tp{tp}"] = {"status": f"skipped: {skip}"}
            print(f"TP{tp}: skipped ({skip})", flush=True)
            continue
        result = run_layout(model, tp, args.cpu_smoke, out, args.timeout)
        for key in ("peak_spec_tflops", "peak_measured_tflops"):
            if report.get(key) and "tflops_per_gpu" in result:
                result[f"mfu_{key.removeprefix('peak_').removesuffix('_tflops')}"] = (
                    result["tflops_per_gpu"] / report[key]
                )
        report["layouts"][f"tp{tp}"] = result
        print(f"TP{tp}: {json.dumps(result)}", flush=True)
    (out / "gpt_throughput.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
