"""One MoE layer, forward + backward, at EP = 1, 2, 4 with each token dispatcher, against the dense MLP with the same
active parameters; and the bytes the dispatcher's collectives move against the all-to-all formula.

Each EP rank is a CPU process (gloo, one thread) holding ``experts / EP`` experts and its own ``--tokens`` tokens
(sequence x micro-batch). The dense baseline is an MLP of FFN width ``topk x moe_ffn`` (what one token computes in
the MoE layer) run on the same tokens with no communication. Throughput is the global tokens per second of a step,
from the median step time of the slowest rank.

Communication is counted by wrapping the collectives the dispatchers call (``all_to_all_single`` for alltoall,
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` for allgather): bytes of every rank's input, summed over the
ranks, per step. For the alltoall dispatcher the hidden-state all-to-alls of one forward pass (dispatch + combine)
are compared with the formula

    2 x tokens x topk x hidden x bytes per element      (tokens summed over the EP ranks; dropless routing)

and the backward pass moves the same again (its gradients travel the reverse way). The routing probabilities
(tokens x topk x 4 bytes, dispatch only) and the split sizes are counted apart.

    python benchmarks/bench_moe.py [--hidden 256 --moe-ffn 512 --experts 8 --topk 2 --tokens 1024 --iters 5]

Prints a table and writes benchmarks/results/moe.json.
"""

import argparse
import json
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec  # noqa: E402
from megatron.core.tensor_parallel import mappings, model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

EP_SIZES = (1, 2, 4)
DISPATCHERS = ("allgather", "alltoall")


class _Traffic:
    """Input bytes of the collectives, by kind (hidden-state all-to-all, other all-to-all, gathers/scatters)."""

    def __init__(self, hidden: int):
        self.hidden = hidden
        self.counts = {}
        self.enabled = False

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        if self.enabled:
            self.counts[kind] = self.counts.get(kind, 0) + tensor.numel() * tensor.element_size()

    def install(self):
        all_to_all_single = dist.all_to_all_single
        all_gather = mappings.all_gather_into_tensor
        reduce_scatter = mappings.reduce_scatter_tensor

        def counted_all_to_all(output, input_, *args, **kwargs):
            is_hidden = input_.dim() == 2 and input_.size(-1) == self.hidden and input_.is_floating_point()
            self.add("a2a hidden" if is_hidden else "a2a other", input_)
            return all_to_all_single(output, input_, *args, **kwargs)

        def counted_all_gather(output, input_, *args, **kwargs):
            self.add("gather/scatter", input_)
            return all_gather(output, input_, *args, **kwargs)

        def counted_reduce_scatter(output, input_, *args, **kwargs):
            self.add("gather/scatter", input_)
            return reduce_scatter(output, input_, *args, **kwargs)

        dist.all_to_all_single = counted_all_to_all
        mappings.all_gather_into_tensor = counted_all_gather
        mappings.reduce_scatter_tensor = counted_reduce_scatter


def _config(args, ep: int, dispatcher: str, moe: bool) -> TransformerConfig:
    common = dict(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=4,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
    )
    if not moe:
        return TransformerConfig(**common, ffn_hidden_size=args.topk * args.moe_ffn)
    return TransformerConfig(
        **common,
        ffn_hidden_size=args.moe_ffn,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.moe_ffn,
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep,
    )


def _time_steps(module, hidden_states, iters: int, warmup: int, traffic: _Traffic):
    """Median forward+backward seconds; the traffic of one counted forward and one counted backward."""
    times, per_pass = [], {}
    for step in range(warmup + iters + 1):
        counting = step == warmup + iters  # one extra, untimed step whose bytes are counted pass by pass
        inputs = hidden_states.detach().requires_grad_(True)
        dist.barrier()
        start = time.perf_counter()
        traffic.counts, traffic.enabled = {}, counting
        output, _ = module(inputs)
        forward_counts = dict(traffic.counts)
        traffic.counts = {}
        output.float().pow(2).mean().backward()
        traffic.enabled = False
        elapsed = time.perf_counter() - start
        if counting:
            per_pass = {"forward": forward_counts, "backward": dict(traffic.counts)}
        elif step >= warmup:
            times.append(elapsed)
    return statistics.median(times), per_pass


def _worker(rank, world, port, args, out_path):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    traffic = _Traffic(args.hidden)
    traffic.install()
    generator = torch.Generator().manual_seed(100 + rank)
    hidden_states = torch.randn(args.tokens // args.micro_batch, args.micro_batch, args.hidden, generator=generator)
    results = []
    variants = [("dense", None)] + [("moe", dispatcher) for dispatcher in DISPATCHERS]
    for kind, dispatcher in variants:
        model_parallel_cuda_manual_seed(1234)
        config = _config(args, world, dispatcher, moe=kind == "moe")
        spec = get_mlp_module_spec(use_te=False, num_experts=config.num_moe_experts)
        module = build_module(spec, config=config)
        if kind == "moe":
            module.set_layer_number(1)
        seconds, per_pass = _time_steps(module, hidden_states, args.iters, args.warmup, traffic)
        slowest = torch.tensor([seconds])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        totals = {}
        for phase, counts in per_pass.items():
            for name, value in counts.items():
                summed = torch.tensor([float(value)])
                dist.all_reduce(summed)
                totals[f"{phase} {name}"] = int(summed.item())
        results.append(
            {
                "ep": world,
                "layer": "dense MLP" if kind == "dense" else f"MoE {dispatcher}",
                "step_s": slowest.item(),
                "tokens_per_s": world * args.tokens / slowest.item(),
                "bytes": totals,
            }
        )
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--moe-ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ep", type=int, nargs="+", default=list(EP_SIZES))
    args = parser.parse_args()

    results_dir = REPO_ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for ep in args.ep:
        out_path = results_dir / f"moe_ep{ep}.json"
        mp.start_processes(_worker, args=(ep, _free_port(), args, str(out_path)), nprocs=ep, start_method="spawn")
        rows += json.loads(out_path.read_text())
        out_path.unlink()

    element = 4  # fp32 hidden states
    print(
        f"hidden {args.hidden}, {args.experts} experts of FFN {args.moe_ffn}, top-{args.topk}, {args.tokens} "
        f"tokens per rank; dense MLP FFN {args.topk * args.moe_ffn}; fp32, one thread per rank"
    )
    header = (
        f"{'EP':>3} {'layer':<14} {'step (ms)':>10} {'tokens/s':>10} {'a2a fwd (MB)':>13} "
        f"{'formula (MB)':>13} {'a2a bwd (MB)':>13} {'other comm fwd+bwd (MB)':>24}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        tokens = row["ep"] * args.tokens
        formula = 2 * tokens * args.topk * args.hidden * element
        b = row["bytes"]
        forward_a2a = b.get("forward a2a hidden", 0)
        backward_a2a = b.get("backward a2a hidden", 0)
        other = sum(value for key, value in b.items() if "a2a hidden" not in key)
        # At EP=1 the dispatcher sends nothing (every expert is local), so the formula applies from EP=2 on.
        applies = row["layer"] == "MoE alltoall" and row["ep"] > 1
        row.update(formula_forward_bytes=formula if applies else None)
        shown_formula = f"{formula / 1e6:13.3f}" if applies else f"{'-':>13}"
        print(
            f"{row['ep']:>3} {row['layer']:<14} {row['step_s'] * 1e3:10.1f} {row['tokens_per_s']:10.0f} "
            f"{forward_a2a / 1e6:13.3f} {shown_formula} {backward_a2a / 1e6:13.3f} {other / 1e6:24.3f}"
        )
    (results_dir / "moe.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
