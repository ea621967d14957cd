"""HF <-> Megatron conversion: time and peak memory of both directions for a large random model (not a test).

    python benchmarks/bench_hf_conversion.py                      # ~0.9B-parameter Llama-style model, bf16
    python benchmarks/bench_hf_conversion.py --layers 4           # smaller, quicker

Writes a random HF checkpoint (streamed, sharded at 1 GB, so this script itself never holds the model), then runs
``tools/checkpoint/convert.py`` HF -> Megatron and Megatron -> HF, each in its own process, sampling that process's
resident memory (VmRSS, and its anonymous part RssAnon) every 20 ms. The claim checked: peak memory stays near the
interpreter's baseline plus a few of the largest tensors, far below the model size. Prints a table and writes
``benchmarks/results/hf_conversion.json``.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

_SAMPLER = (
    r"""
import json, os, runpy, sys, threading, time
peak = {"VmRSS": 0, "RssAnon": 0}
def sample():
    while True:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in peak:
                    peak[key] = max(peak[key], int(line.split()[1]))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
mode, out = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
start = time.perf_counter()
if mode == "baseline":
    import torch, safetensors, megatron.core.models.huggingface, megatron.training.checkpointing
else:
    sys.argv = ["convert.py"] + sys.argv[1:]
    try:
        runpy.run_path(os.path.join(%r, "tools", "checkpoint", "convert.py"), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code:
            raise
elapsed = time.perf_counter() - start
time.sleep(0.05)
with open(out, "w") as f:
    json.dump({"seconds": elapsed, "peak_rss_mb": peak["VmRSS"] / 1024, "peak_anon_mb": peak["RssAnon"] / 1024}, f)
"""
    % REPO_ROOT
)


def write_random_hf_model(
    directory: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int, dtype: torch.dtype
):
    """A random LlamaForCausalLM checkpoint written one tensor at a time; returns (its bytes, the largest
    tensor's bytes, its parameter count)."""
    from megatron.core.models.huggingface.families import FAMILIES
    from megatron.core.models.huggingface.conversion import expand_rules, _hf_names_expected
    from megatron.core.models.huggingface.weights import write_safetensors_streamed

    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "hidden_act": "silu",
        "dtype": str(dtype).replace("torch.", ""),
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(config, file)
    family = FAMILIES["llama"]
    settings = family.settings_from_hf(config)
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    for layer in range(layers):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    names = _hf_names_expected(expand_rules(family, settings), settings)
    entries = [(name, torch.Size(shapes[name]), dtype) for name in names]
    generator = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape, _ in entries:
            yield name, (torch.randn(shape, generator=generator) * 0.02).to(dtype)

    write_safetensors_streamed(directory, entries, tensors(), max_shard_bytes=10**9)
    element = torch.empty((), dtype=dtype).element_size()
    numels = [shape.numel() for _, shape, _ in entries]
    return sum(numels) * element, max(numels) * element, sum(numels)


def _weight_map(directory: str) -> dict:
    from safetensors import safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as file:
            return json.load(file)["weight_map"]
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as handle:
        return {name: "model.safetensors" for name in handle.keys()}


def measure(mode: str, arguments, workdir: str) -> dict:
    out = os.path.join(workdir, f"{mode}.json")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _SAMPLER, mode, out, *arguments], env=env, capture_output=True, text=True
    )
    if result.returncode:
        raise RuntimeError(f"{mode} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    with open(out) as file:
        return json.load(file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--workdir", default=None, help="Where the checkpoints go (default: a temporary directory).")
    args = parser.parse_args()

    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_hf_")
    hf_dir, megatron_dir, back_dir = (os.path.join(workdir, name) for name in ("hf", "megatron", "hf_back"))
    try:
        start = time.perf_counter()
        model_bytes, largest_bytes, params = write_random_hf_model(
            hf_dir,
            args.layers,
            args.hidden,
            args.ffn,
            args.heads,
            args.kv_heads,
            args.vocab,
            getattr(torch, args.dtype),
        )
        print(
            f"random HF model: {params / 1e9:.2f}B parameters, {model_bytes / 2**20:.0f} MiB ({args.dtype}), "
            f"largest tensor {largest_bytes / 2**20:.0f} MiB, written in {time.perf_counter() - start:.1f} s"
        )
        # The same conversions of a tiny model measure the fixed cost (interpreter, torch, process group, DCP).
        tiny = os.path.join(workdir, "tiny")
        write_random_hf_model(tiny, 2, 64, 128, 4, 2, 256, getattr(torch, args.dtype))
        rows = {"baseline (imports only)": measure("baseline", [], workdir)}
        for label, (source, megatron, back) in {
            "tiny model": (tiny, tiny + "_megatron", tiny + "_back"),
            "model": (hf_dir, megatron_dir, back_dir),
        }.items():
            rows[f"HF -> Megatron (torch_dist), {label}"] = measure(
                "convert",
                [
                    "--model-type",
                    "GPT",
                    "--loader",
                    "hf",
                    "--saver",
                    "core",
                    "--load-dir",
                    source,
                    "--save-dir",
                    megatron,
                ],
                workdir,
            )
            rows[f"Megatron -> HF (safetensors), {label}"] = measure(
                "convert",
                [
                    "--model-type",
                    "GPT",
                    "--loader",
                    "core",
                    "--saver",
                    "hf",
                    "--load-dir",
                    megatron,
                    "--save-dir",
                    back,
                    "--max-shard-size",
                    "1GB",
                ],
                workdir,
            )
        from safetensors import safe_open

        identical = True
        back_map, source_map = _weight_map(back_dir), _weight_map(hf_dir)
        for name in source_map:
            with (
                safe_open(os.path.join(hf_dir, source_map[name]), "pt") as a,
                safe_open(os.path.join(back_dir, back_map[name]), "pt") as b,
            ):
                identical &= torch.equal(a.get_tensor(name), b.get_tensor(name))
        print("\n| run | time (s) | peak RSS (MiB) | peak anon (MiB) | RSS above the tiny-model run (MiB) |")
        print("|---|---|---|---|---|")
        for name, row in rows.items():
            tiny_row = rows.get(name.replace(", model", ", tiny model"))
            above = f"{row['peak_rss_mb'] - tiny_row['peak_rss_mb']:.0f}" if name.endswith(", model") else ""
            print(f"| {name} | {row['seconds']:.1f} | {row['peak_rss_mb']:.0f} | {row['peak_anon_mb']:.0f} | {above} |")
        print(f"\nmodel {model_bytes / 2**20:.0f} MiB")
        print(f"\nround trip bit-identical: {identical}; largest tensor {largest_bytes / 2**20:.0f} MiB")
        os.makedirs(os.path.join(REPO_ROOT, "benchmarks", "results"), exist_ok=True)
        with open(os.path.join(REPO_ROOT, "benchmarks", "results", "hf_conversion.json"), "w") as file:
            json.dump(
                {
                    "parameters": params,
                    "model_bytes": model_bytes,
                    "largest_tensor_bytes": largest_bytes,
                    "dtype": args.dtype,
                    "rows": rows,
                    "round_trip_identical": identical,
                },
                file,
                indent=2,
            )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
