"""Forward+backward time of our GPTModel at TP=1 against a plain-PyTorch GPT of the same architecture.

The plain model below is written independently of megatron.core (same shapes, same ops: fused QKV projection,
PyTorch SDPA with a causal mask, GELU MLP, pre-LayerNorm, untied output layer, fp32 cross entropy). Both run on
one CPU process; timings alternate between the two models so machine noise hits both alike.

    python benchmarks/bench_gpt_vs_plain.py [--layers 4 --hidden 512 --heads 8 --seq 512 --batch 4 --iters 10]
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig


class PlainBlock(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x):  # x: [s, b, h], as in our model
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, self.heads, 3 * h // self.heads).chunk(3, dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(torch.nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int, heads: int, ffn: int, layers: int):
        super().__init__()
        self.word = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(seq, hidden)
        self.blocks = torch.nn.ModuleList(PlainBlock(hidden, heads, ffn) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.out = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens, positions, labels):
        x = (self.word(tokens) + self.pos(positions)).transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        logits = self.out(self.ln_f(x))  # [s, b, v]
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.transpose(0, 1).flatten(), reduction="none")
        return loss.view(labels.shape[1], labels.shape[0]).transpose(0, 1)


def build_ours(args):
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq)


def step_time(model, inputs) -> float:
    start = time.perf_counter()
    loss = model(*inputs)
    loss.mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(1234)

    ours = build_ours(args)
    plain = PlainGPT(args.vocab, args.seq, args.hidden, args.heads, 4 * args.hidden, args.layers)
    n_ours = sum(p.numel() for p in ours.parameters())
    n_plain = sum(p.numel() for p in plain.parameters())
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)
    ours_inputs = (tokens, positions, None, None, labels)
    plain_inputs = (tokens, positions, labels)
    ours_adapter = _Adapter(ours)

    for _ in range(args.warmup):
        step_time(ours_adapter, ours_inputs)
        step_time(plain, plain_inputs)
    times = {"megatron-lite GPTModel (TP=1)": [], "plain PyTorch GPT": []}
    for _ in range(args.iters):  # alternate, so drifts in machine load hit both
        times["megatron-lite GPTModel (TP=1)"].append(step_time(ours_adapter, ours_inputs))
        times["plain PyTorch GPT"].append(step_time(plain, plain_inputs))

    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["megatron-lite GPTModel (TP=1)"] / medians["plain PyTorch GPT"]
    print(
        f"\nGPT fwd+bwd on CPU: layers={args.layers} hidden={args.hidden} heads={args.heads} seq={args.seq} "
        f"batch={args.batch} vocab={args.vocab} threads={torch.get_num_threads()} iters={args.iters}"
    )
    print(f"{'model':32s} {'params':>12s} {'median s':>10s} {'min s':>8s} {'max s':>8s}")
    for (name, values), params in zip(times.items(), (n_ours, n_plain)):
        print(f"{name:32s} {params:12,d} {medians[name]:10.3f} {min(values):8.3f} {max(values):8.3f}")
    print(f"ratio ours / plain (median): {ratio:.3f}   target <= 1.05")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "gpt_vs_plain.json").write_text(
        json.dumps({"args": vars(args), "seconds": times, "median": medians, "ratio": ratio}, indent=2)
    )
    dist.destroy_process_group()


class _Adapter(torch.nn.Module):
    """Calls our GPTModel with the plain model's argument order (tokens, positions, mask, decoder_input, labels)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, attention_mask, decoder_input, labels):
        return self.model(tokens, positions, attention_mask, labels=labels)


if __name__ == "__main__":
    main()
