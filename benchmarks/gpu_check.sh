#!/usr/bin/env bash
# GPU check (issue 24, item 4): on a CUDA machine, run the GPU-marked tests (among them our Triton kernels compiled
# for this GPU and run on CUDA tensors against PyTorch), then time a ~1.3B GPT in bf16 through pretrain_gpt.py at
# TP1 and TP2 (TP2 says skipped with one GPU), printing tokens/s and MFU. About 6-8 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh                 # everything goes to $OUT (default /tmp/gpu_check)
#   device run: bash benchmarks/gpu_check.sh     # with timeout_s ~540
#
# Nothing is downloaded: the machine's own torch and Triton run the project from this checkout (PYTHONPATH; the
# project has no compiled parts to install). CI never runs this. docs/benchmarks.md says how to read the numbers.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
"$PY" - <<'PY' 2>&1 | tee -a "$OUT/gpu.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
import triton
print("triton", triton.__version__)
import megatron.core  # the project imports with the machine's packages
print("megatron.core from", megatron.core.__file__)
PY
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "no CUDA device visible: nothing to check" | tee -a "$OUT/gpu.txt"
    exit 1
}

echo "== GPU-marked tests (Triton kernels compiled and run on CUDA included)"
timeout 180 "$PY" -m pytest tests -m gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
tests_status=$?

echo "== GPT ~1.3B bf16 (24 layers, hidden 2048, 16 heads, seq 2048), TP1 and TP2"
timeout 420 "$PY" benchmarks/bench_gpt_gpu.py --tp 1,2 --out "$OUT" --timeout 190 2>&1 | tee "$OUT/gpt_1p3b.txt"
bench_status=$?

echo "== done: tests exit $tests_status, timing exit $bench_status; files in $OUT"
exit $((tests_status || bench_status))
