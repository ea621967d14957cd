"""Forward+backward throughput and memory of the Mamba-2 mixer: chunked SSD vs a sequential scan vs attention.

Three sequence mixers of the same width, each one layer, TP=1, fp32, on one process:

- ``mamba (chunked SSD)``: MambaMixer as built, running ``ssd_chunked_scan``;
- ``mamba (sequential)``: the same mixer with the scan replaced by the step-by-step recurrence below (one Python
  iteration per token: what the SSD algorithm replaces);
- ``attention``: Megatron's SelfAttention from the local GPT spec (``hidden / 64`` heads of 64, causal), whose
  DotProductAttention runs PyTorch's ``scaled_dot_product_attention`` (a fused kernel that does not keep the
  ``[b, heads, s, s]`` scores for backward).

Tokens/s counts ``batch * seq`` per forward+backward. Memory is the peak allocated on CUDA; on CPU (no allocator
statistics) it is the bytes of the tensors autograd saves for backward (distinct storages), the activation memory
that grows with the sequence. A run past ``--max-seconds`` for one configuration is skipped for longer sequences.

    python benchmarks/bench_mamba_mixer.py [--hidden 256 --seqs 512,1024,2048,4096,8192 --batch 1 --iters 2]
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.ssm import mamba_mixer
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, model_parallel_cuda_manual_seed
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig


def sequential_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, **unused):
    """The recurrence one step at a time (vectorised over batch and heads); ``ssd_chunked_scan``'s arguments."""
    batch, seqlen, nheads, headdim = x.shape
    heads_per_group = nheads // B.shape[2]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    dt = F.softplus(dt) if dt_softplus else dt
    B, C = B.float().repeat_interleave(heads_per_group, 2), C.float().repeat_interleave(heads_per_group, 2)
    state = x.new_zeros(batch, nheads, headdim, B.shape[-1], dtype=torch.float32)
    decay = torch.exp(dt * A.float())  # [b, l, h]
    outputs = []
    for t in range(seqlen):
        update = (dt[:, t, :, None] * x[:, t].float()).unsqueeze(-1) * B[:, t, :, None]
        state = decay[:, t, :, None, None] * state + update
        outputs.append((state * C[:, t, :, None]).sum(-1))
    y = torch.stack(outputs, dim=1)
    if D is not None:
        y = y + x.float() * (D.float().unsqueeze(-1) if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def build(kind, args):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mamba_state_dim=args.state,
        mamba_head_dim=64,
        mamba_num_groups=args.groups,
    )
    if kind == "attention":
        return build_module(get_gpt_layer_local_submodules().self_attention, config=config, layer_number=1)
    submodules = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    return MambaMixer(config, submodules, d_model=args.hidden, chunk_size=args.chunk)


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while active."""

    def __init__(self):
        self.storages = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self):
        return sum(self.storages.values())


def step(module, x, device):
    """One forward+backward; (seconds, memory bytes)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with SavedBytes() as saved:
        # attention_mask=None: the causal mask is built inside (attention only; the mixer is causal by itself).
        out, bias = module(x, None) if isinstance(module, Attention) else module(x)
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    module.zero_grad(set_to_none=True)
    memory = torch.cuda.max_memory_allocated() if device.type == "cuda" else saved.total
    return elapsed, memory


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--state", type=int, default=64)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqs", default="512,1024,2048,4096,8192")
    parser.add_argument("--iters", type=int, default=2, help="timed iterations after one warm-up")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="skip longer sequences of a mixer past this")
    parser.add_argument("--kinds", default="mamba (chunked SSD),mamba (sequential),attention")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29537")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(1234)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)

    kinds = args.kinds.split(",")
    modules = {kind: build(kind, args) for kind in kinds}
    results, too_slow = [], set()
    for seq in [int(s) for s in args.seqs.split(",")]:
        x = torch.randn(seq, args.batch, args.hidden, device=device, requires_grad=True)
        for kind in kinds:
            if kind in too_slow:
                results.append(dict(kind=kind, seq=seq, tokens_per_s=None, memory_mib=None))
                continue
            if kind == "mamba (sequential)":
                mamba_mixer.ssd_chunked_scan, original = sequential_scan, mamba_mixer.ssd_chunked_scan
            try:
                step(modules[kind], x, device)  # warm-up
                timings = [step(modules[kind], x, device) for _ in range(args.iters)]
            finally:
                if kind == "mamba (sequential)":
                    mamba_mixer.ssd_chunked_scan = original
            seconds = min(t for t, _ in timings)
            if seconds > args.max_seconds:
                too_slow.add(kind)
            results.append(
                dict(kind=kind, seq=seq, tokens_per_s=args.batch * seq / seconds, memory_mib=timings[0][1] / 2**20)
            )

    memory_name = "peak MiB" if device.type == "cuda" else "saved MiB"
    print(
        f"\nMamba-2 mixer vs attention, fwd+bwd, one layer: hidden={args.hidden} d_state={args.state} "
        f"groups={args.groups} headdim=64 chunk={args.chunk} batch={args.batch} device={device.type} "
        f"threads={torch.get_num_threads()}"
    )
    print(f"{'seq':>6s} " + " ".join(f"{kind + ' tok/s':>28s} {memory_name:>10s}" for kind in kinds))
    for seq in sorted({r["seq"] for r in results}):
        cells = []
        for kind in kinds:
            row = next(r for r in results if r["seq"] == seq and r["kind"] == kind)
            if row["tokens_per_s"] is None:
                cells.append(f"{'skipped':>28s} {'':>10s}")
            else:
                cells.append(f"{row['tokens_per_s']:28,.0f} {row['memory_mib']:10.1f}")
        print(f"{seq:6d} " + " ".join(cells))
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "mamba_mixer.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
