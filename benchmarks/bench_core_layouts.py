"""Training-step time of the reference GPT through the ``megatron.core`` API, every layout side by side.

The model of issue 24's numbers (4 layers, hidden 256, 8 heads, seq 256, vocab 8192, fp32, no dropout), built with
``GPTModel`` and the local layer spec, wrapped in Megatron's ``DistributedDataParallel``, stepped by
``get_megatron_optimizer`` (Adam, clipping at 1.0) after ``get_forward_backward_func()`` runs the global batch of 16
sequences in micro-batches of 4. A step is that whole sequence. Each layout runs in its own process group on the
machine's cores (1 rank x 2 threads for TP1, 2 ranks x 1 thread for the others), and the layouts alternate within
each repeat, so load from other processes falls on all of them alike.

The script touches nothing but the public ``megatron.core`` API, so it runs unchanged against any source tree that
provides it: ``--source name=PATH`` (repeatable) puts PATH first on ``PYTHONPATH`` for that column, e.g. an older
checkout of this project (``git worktree add /tmp/old <commit>``) to find a regression, or Megatron-Core itself.

    python benchmarks/bench_core_layouts.py [--layouts tp1,tp2,pp2,dp2 --iters 8 --repeats 2 --source old=/tmp/old]

Prints the median step time per (source, layout) and writes benchmarks/results/core_layouts.json.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 4, 256, 8, 256, 8192
MICRO_BATCH, GLOBAL_BATCH = 4, 16
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2), "dp2": (2, 1, 1)}  # ranks, TP, PP
CORES = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- one rank -------------------------------------------------------------------------------------------------------


def _build(tp: int, pp: int):
    import torch

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-4, weight_decay=0.01, clip_grad=1.0), [model]
    )
    return model, optimizer


def _batches(count: int):
    import torch

    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (count, MICRO_BATCH, SEQ + 1), generator=generator)
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous(), position_ids) for t in tokens]


def _rank_main(rank: int, world: int, tp: int, pp: int, iters: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    torch.set_num_threads(CORES // world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    model, optimizer = _build(tp, pp)
    microbatches = GLOBAL_BATCH // MICRO_BATCH // parallel_state.get_data_parallel_world_size()
    batches = _batches(microbatches)

    def forward_step(data_iterator, model):
        tokens, labels, position_ids = next(data_iterator)
        output = model(tokens, position_ids, None, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    times = []
    for _ in range(iters + 2):  # the first two steps warm up
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=microbatches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times[2:]))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _worker(args) -> None:
    import torch.multiprocessing as mp

    world, tp, pp = LAYOUTS[args.layout]
    mp.start_processes(
        _rank_main, args=(world, tp, pp, args.iters, _free_port(), args.out), nprocs=world, start_method="fork"
    )


# ---- the driver -----------------------------------------------------------------------------------------------------


def _run(source: Path, layout: str, iters: int) -> list:
    out = REPO_ROOT / "benchmarks" / "results" / f".core_layouts_{os.getpid()}.json"
    environment = dict(os.environ, PYTHONPATH=f"{source}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    environment.update(OMP_NUM_THREADS="1")  # each rank sets its own thread count
    command = [sys.executable, __file__, "--worker", "--layout", layout, "--iters", str(iters), "--out", str(out)]
    subprocess.run(command, env=environment, check=True, cwd=source)
    times = json.loads(out.read_text())
    out.unlink()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default="tp1,tp2,pp2,dp2")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--source", action="append", default=[], help="name=PATH of another source tree to time")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    sources = {"this": REPO_ROOT} | {s.split("=", 1)[0]: Path(s.split("=", 1)[1]).resolve() for s in args.source}
    layouts = args.layouts.split(",")
    times = {(name, layout): [] for name in sources for layout in layouts}
    for _ in range(args.repeats):
        for layout in layouts:
            for name, source in sources.items():
                times[(name, layout)] += _run(source, layout, args.iters)
    print(f"{'layout':<8}" + "".join(f"{name + ' ms':>14}" for name in sources) + "   (median step, all repeats)")
    rows = []
    for layout in layouts:
        medians = {name: 1000 * statistics.median(times[(name, layout)]) for name in sources}
        print(f"{layout:<8}" + "".join(f"{medians[name]:>14.1f}" for name in sources))
        rows.append({"layout": layout, **{f"{name}_ms": medians[name] for name in sources}})
    (REPO_ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (REPO_ROOT / "benchmarks" / "results" / "core_layouts.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
