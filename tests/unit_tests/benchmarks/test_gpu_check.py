"""benchmarks/gpu_check.sh and its timing script, as far as they run without a GPU: the shell script parses, the
layouts plan and the log parsing are right, and the timing script trains the tiny --cpu-smoke model end to end."""

import importlib.util
import json
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("bench_gpt_gpu", REPO_ROOT / "benchmarks" / "bench_gpt_gpu.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_gpu_check_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(REPO_ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_a_layout_needing_more_gpus_than_visible_is_skipped():
    assert bench.plan([1, 2], 1, cpu=False) == [(1, None), (2, "needs 2 GPUs, 1 visible")]
    assert bench.plan([1, 2], 0, cpu=True) == [(1, None), (2, None)]  # gloo processes on CPU


def test_flags_are_the_1p3b_model_in_bf16_with_sequence_parallel_at_tp2():
    flags = bench.pretrain_flags(bench.MODEL_1P3B, 2, cpu=False)
    for flag in ("--num-layers=24", "--hidden-size=2048", "--num-attention-heads=16", "--seq-length=2048"):
        assert flag in flags
    assert {"--bf16", "--sequence-parallel", "--tensor-model-parallel-size=2"} <= set(flags)
    assert "--sequence-parallel" not in bench.pretrain_flags(bench.MODEL_1P3B, 1, cpu=False)


def test_log_parsing_drops_the_warm_up_interval():
    line = (
        " [2026-12-03] iteration {it:8d}/      20 | consumed samples: 1 | elapsed time per iteration (ms): {ms} | "
        "throughput per GPU (TFLOP/s/GPU): {tf} | learning rate: 1.0E-04 |"
    )
    text = "\n".join(
        line.format(it=it, ms=ms, tf=tf)
        for it, ms, tf in ((5, 9000.0, 1.0), (10, 2000.0, 300.0), (15, 2200.0, 280.0), (20, 2100.0, 290.0))
    )
    numbers = bench.parse_log(text, global_batch=32, seq=2048)
    assert numbers["step_ms"] == 2100.0 and numbers["tflops_per_gpu"] == 290.0 and numbers["intervals"] == 3
    assert numbers["tokens_per_s"] == 32 * 2048 / 2.1
    assert bench.parse_log("no iteration lines", 32, 2048) is None
    assert bench.spec_peak("NVIDIA H200") == 989.0 and bench.spec_peak("a CPU") is None


def test_cpu_smoke_run_trains_and_reports(tmp_path):
    report = bench.main(["--cpu-smoke", "--tp", "1", "--out", str(tmp_path)])
    result = report["layouts"]["tp1"]
    assert result["status"] == "exit 0", (tmp_path / "tp1.log").read_text()[-2000:]
    assert result["intervals"] >= 3 and result["tokens_per_s"] > 0
    assert json.loads((tmp_path / "gpt_throughput.json").read_text())["layouts"]["tp1"] == result
