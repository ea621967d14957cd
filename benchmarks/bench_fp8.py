"""FP8 recipes on CPU: quantisation error per recipe against torchao's reference quantisers, FP8 GEMM error, and a
short training run of a tiny GPT per recipe next to the unquantised (fp32) and bf16 runs.

    python benchmarks/bench_fp8.py [--steps 20 --threads 2]

1. Quantisation: a 1024 x 1024 activation-like tensor (Gaussian with 1% outlier channels, 30x larger), each recipe
   and format: signal-to-quantisation-noise ratio (SQNR, dB) of the dequantised tensor, and the largest difference
   from torchao's dequantised result (0 = the same bytes and scales; torchao optional).
2. GEMM: relative Frobenius error of the FP8 GEMM (x @ w.T, E4M3 operands) against fp32.
3. Training: losses of a 2-layer GPT (hidden 128, FFN 512, seq 64 x batch 8, vocab 512, Adam 3e-3, one fixed batch)
   per recipe (hybrid format, fp32 parameters) next to fp32 and bf16, and the median step time, the runs' steps
   interleaved (CPU emulation: FP8 is slower than fp32 here, since the quantisation passes come on top of an fp32
   GEMM; no FP8 GEMM runs on a CPU).

Prints tables and writes benchmarks/results/fp8.json.
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.core.fp8.quantization import (  # noqa: E402
    E4M3,
    E5M2,
    quantize_blockwise,
    quantize_mxfp8,
    quantize_tensorwise,
    scaled_matmul,
)

RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")


def _ours(recipe, t, dtype, weight=False):
    if recipe in ("tensorwise", "delayed"):  # delayed = tensorwise with last step's amax; here: the same tensor's
        return quantize_tensorwise(t, dtype)
    if recipe == "mxfp8":
        return quantize_mxfp8(t, dtype)
    return quantize_blockwise(t, dtype, (128, 128) if weight else (1, 128))


def _torchao(recipe, t, dtype, weight=False):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
            from torchao.prototype.blockwise_fp8_training.kernels import (
                torch_blockwise_scale_act_quant_lhs,
                torch_blockwise_scale_weight_quant,
            )
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except ImportError:
        return None
    if recipe in ("tensorwise", "delayed"):
        scale = tensor_to_scale(t, dtype)
        return to_fp8_saturated(t * scale, dtype).float() / scale
    if recipe == "mxfp8":
        scale, data = to_mx(t, dtype, 32, ScaleCalculationMode.RCEIL)
        return to_dtype(data, scale, dtype, 32, torch.float32)
    if dtype != E4M3:
        return None  # torchao's DeepSeek-style reference is E4M3 only
    if weight:
        data, scale_inv = torch_blockwise_scale_weight_quant(t, 128, dtype)
        return data.float() * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    data, scale_inv = torch_blockwise_scale_act_quant_lhs(t, 128, dtype)
    return data.float() * scale_inv.repeat_interleave(128, 1)


def _sqnr(reference, approx):
    return (10 * torch.log10(reference.pow(2).sum() / (reference - approx).pow(2).sum())).item()


def quantisation_table():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1024, generator=generator)
    x[:, torch.randperm(1024, generator=generator)[:10]] *= 30
    w = torch.randn(1024, 1024, generator=generator) * 0.02
    rows = []
    for recipe in RECIPES:
        for dtype, name in ((E4M3, "e4m3"), (E5M2, "e5m2")):
            ours = _ours(recipe, x, dtype).dequantize()
            reference = _torchao(recipe, x, dtype)
            gap = None if reference is None else (ours - reference).abs().max().item()
            rows.append({"recipe": recipe, "format": name, "sqnr_db": _sqnr(x, ours), "max_diff_vs_torchao": gap})
        y = scaled_matmul(_ours(recipe, x, E4M3), _ours(recipe, w, E4M3, weight=True), torch.float32)
        exact = x @ w.t()
        rows[-1]["gemm_rel_error"] = rows[-2]["gemm_rel_error"] = ((y - exact).norm() / exact.norm()).item()
    return rows


def _init_single_process():
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)


def build(fp8_recipe=None, bf16=False):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    fp8 = {} if fp8_recipe is None else {"fp8": "hybrid", "fp8_recipe": fp8_recipe, "fp8_amax_history_len": 16}
    config = TransformerConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=512,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        **fp8,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=512, max_sequence_length=64)
    return model.bfloat16() if bf16 else model


def train(runs, steps):
    """Train every model of ``runs`` (label -> model) on one fixed batch, one step of each in turn, so that load
    on the shared machine hits all runs alike."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 512, (8, 64), generator=generator)
    labels = torch.randint(0, 512, (8, 64), generator=generator)
    positions = torch.arange(64).unsqueeze(0).expand(8, 64)
    optimizers = {label: torch.optim.Adam(model.parameters(), lr=3e-3) for label, model in runs.items()}
    losses = {label: [] for label in runs}
    times = {label: [] for label in runs}
    for _ in range(steps):
        for label, model in runs.items():
            start = time.perf_counter()
            loss = model(tokens, positions, None, labels=labels).float().mean()
            optimizers[label].zero_grad()
            loss.backward()
            optimizers[label].step()
            times[label].append(time.perf_counter() - start)
            losses[label].append(loss.item())
    return [{"run": label, "losses": losses[label], "step_s": statistics.median(times[label])} for label in runs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    quantisation = quantisation_table()
    print("| recipe | format | SQNR (dB) | max diff vs torchao | FP8 GEMM rel. error (e4m3) |")
    print("|---|---|---|---|---|")
    for row in quantisation:
        gap = "n/a" if row["max_diff_vs_torchao"] is None else f"{row['max_diff_vs_torchao']:.1e}"
        print(f"| {row['recipe']} | {row['format']} | {row['sqnr_db']:.1f} | {gap} | {row['gemm_rel_error']:.2e} |")

    _init_single_process()
    models = {"fp32": build(), "bf16 (parameters and Adam in bf16)": build(bf16=True)}
    models.update({f"fp8 hybrid {recipe}": build(recipe) for recipe in RECIPES})
    runs = train(models, args.steps)
    baseline = runs[0]["losses"]
    print(f"\n| run | loss at step 1 / {args.steps // 2} / {args.steps} | max rel. diff vs fp32 | median step (s) |")
    print("|---|---|---|---|")
    for run in runs:
        losses = run["losses"]
        diff = max(abs(a - b) / b for a, b in zip(losses, baseline))
        marks = f"{losses[0]:.4f} / {losses[args.steps // 2 - 1]:.4f} / {losses[-1]:.4f}"
        print(f"| {run['run']} | {marks} | {diff:.1e} | {run['step_s']:.3f} |")

    out = REPO_ROOT / "benchmarks" / "results" / "fp8.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"quantisation": quantisation, "training": runs}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
