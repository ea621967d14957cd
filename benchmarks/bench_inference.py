"""Generation speed on CPU: our engines vs Hugging Face transformers ``generate()`` on the same ~25M-parameter GPT.

Our GPTModel (GPT-2 style: learned positions, LayerNorm, exact GELU, tied embeddings) is built from a seed; an
equivalent ``transformers.GPT2LMHeadModel`` is built from the same sizes and the weights are copied over (the fused
QKV is reordered from Megatron's per-head [q, k, v] layout to GPT-2's [all q, all k, all v], linear weights are
transposed for GPT-2's Conv1D). The script first checks the two models' logits agree, then for each batch size
times, with greedy decoding and a fixed number of new tokens (no early stop):

* time to first token (TTFT): a generate call with 1 new token (prefill of the whole batch plus one sample);
* decode tokens/s: ``batch * (N - 1) / (t(N new tokens) - t(1 new token))``, the same for both;

timed by default as this process's CPU time on one thread (``--clock cpu``), best of ``--repeats`` with the
engines taking turns, because a shared machine's load swamps wall-clock differences;

for our dynamic engine (paged KV cache, continuous batching), our static engine (contiguous cache) and HF. It also
compares the KV-cache bytes each holds with the formula ``2 x layers x kv_heads x head_dim x tokens x bytes``.

    python benchmarks/bench_inference.py [--models gpt2 llama --batches 1 8 32 --prompt 32 --new-tokens 32
                                          --repeats 3 --threads 1 --clock cpu --compare-layouts]
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.inference.contexts import DynamicInferenceContext
from megatron.core.inference.engines import DynamicInferenceEngine, StaticInferenceEngine
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers import TextGenerationController
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.transformer.transformer_config import TransformerConfig


def build_ours(args, family: str) -> GPTModel:
    common = dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    if family == "gpt2":
        config = TransformerConfig(ffn_hidden_size=4 * args.hidden, **common)
        position = "learned_absolute"
    else:
        config = TransformerConfig(
            ffn_hidden_size=3 * args.hidden,
            num_query_groups=args.kv_heads,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            **common,
        )
        position = "rope"
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.vocab,
        max_sequence_length=args.max_seq,
        share_embeddings_and_output_weights=True,
        position_embedding_type=position,
    ).eval()


def build_hf(args, ours: GPTModel, family: str):
    """The same network in transformers, with our weights copied in."""
    import transformers

    src = {name: p.detach() for name, p in ours.named_parameters()}
    h, heads = args.hidden, args.heads
    d = h // heads
    common = dict(
        vocab_size=args.vocab, bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1, tie_word_embeddings=True
    )
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_positions=args.max_seq,
            n_embd=h,
            n_layer=args.layers,
            n_head=heads,
            activation_function="gelu",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
            **common,
        )
        config._attn_implementation = "sdpa"
        hf = transformers.GPT2LMHeadModel(config).eval()
        copy_gpt2(hf, src, args.layers, heads, d, h)
    else:
        config = transformers.LlamaConfig(
            hidden_size=h,
            intermediate_size=3 * h,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.max_seq,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            attention_bias=False,
            mlp_bias=False,
            **common,
        )
        config._attn_implementation = "sdpa"
        hf = transformers.LlamaForCausalLM(config).eval()
        copy_llama(hf, src, args.layers, heads, args.kv_heads, d, h)
    return hf


def copy_gpt2(hf, src, layers, heads, d, h):
    with torch.no_grad():
        hf.transformer.wte.weight.copy_(src["embedding.word_embeddings.weight"])
        hf.transformer.wpe.weight.copy_(src["embedding.position_embeddings.weight"])
        for i, block in enumerate(hf.transformer.h):
            p = f"decoder.layers.{i}."
            block.ln_1.weight.copy_(src[p + "input_layernorm.weight"])
            block.ln_1.bias.copy_(src[p + "input_layernorm.bias"])
            # [heads, (q, k, v), d, h] -> [(q, k, v), heads, d, h]: GPT-2's all-q, all-k, all-v order.
            qkv_w = src[p + "self_attention.linear_qkv.weight"].view(heads, 3, d, h).transpose(0, 1).reshape(3 * h, h)
            qkv_b = src[p + "self_attention.linear_qkv.bias"].view(heads, 3, d).transpose(0, 1).reshape(3 * h)
            block.attn.c_attn.weight.copy_(qkv_w.t())  # Conv1D weights are [in, out]
            block.attn.c_attn.bias.copy_(qkv_b)
            block.attn.c_proj.weight.copy_(src[p + "self_attention.linear_proj.weight"].t())
            block.attn.c_proj.bias.copy_(src[p + "self_attention.linear_proj.bias"])
            block.ln_2.weight.copy_(src[p + "pre_mlp_layernorm.weight"])
            block.ln_2.bias.copy_(src[p + "pre_mlp_layernorm.bias"])
            block.mlp.c_fc.weight.copy_(src[p + "mlp.linear_fc1.weight"].t())
            block.mlp.c_fc.bias.copy_(src[p + "mlp.linear_fc1.bias"])
            block.mlp.c_proj.weight.copy_(src[p + "mlp.linear_fc2.weight"].t())
            block.mlp.c_proj.bias.copy_(src[p + "mlp.linear_fc2.bias"])
        hf.transformer.ln_f.weight.copy_(src["decoder.final_layernorm.weight"])
        hf.transformer.ln_f.bias.copy_(src["decoder.final_layernorm.bias"])


def copy_llama(hf, src, layers, heads, kv_heads, d, h):
    per_group = heads // kv_heads
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(src["embedding.word_embeddings.weight"])
        for i, layer in enumerate(hf.model.layers):
            p = f"decoder.layers.{i}."
            layer.input_layernorm.weight.copy_(src[p + "input_layernorm.weight"])
            # Per query group [its q heads, k, v]; HF's query head j belongs to group j // per_group as well.
            qkv = src[p + "self_attention.linear_qkv.weight"].view(kv_heads, per_group + 2, d, h)
            layer.self_attn.q_proj.weight.copy_(qkv[:, :per_group].reshape(heads * d, h))
            layer.self_attn.k_proj.weight.copy_(qkv[:, per_group].reshape(kv_heads * d, h))
            layer.self_attn.v_proj.weight.copy_(qkv[:, per_group + 1].reshape(kv_heads * d, h))
            layer.self_attn.o_proj.weight.copy_(src[p + "self_attention.linear_proj.weight"])
            layer.post_attention_layernorm.weight.copy_(src[p + "pre_mlp_layernorm.weight"])
            gate, up = src[p + "mlp.linear_fc1.weight"].chunk(2, dim=0)  # SwiGLU: act(first half) * second half
            layer.mlp.gate_proj.weight.copy_(gate)
            layer.mlp.up_proj.weight.copy_(up)
            layer.mlp.down_proj.weight.copy_(src[p + "mlp.linear_fc2.weight"])
        hf.model.norm.weight.copy_(src["decoder.final_layernorm.weight"])


def check_same_model(ours, hf, args) -> float:
    ids = torch.randint(0, args.vocab, (2, args.prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(ids, torch.arange(args.prompt)[None].expand(2, -1), None)
        b = hf(ids).logits
    error = ((a - b).abs().max() / b.abs().max()).item()
    if error > 1e-4:
        raise SystemExit(f"the HF model does not match ours (max relative logit difference {error:.2e})")
    return error


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def time_engines(makers, batch, args):
    """{name: (ttft, decode tok/s, kv bytes)}; the engines take turns in every repeat (min over repeats), so a
    burst of load on a shared machine hits them alike."""
    engines = {name: make(batch) for name, make in makers}
    for generate, _ in engines.values():
        generate(2)  # warm-up (allocates the cache, first-call overheads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    best = {name: [float("inf"), float("inf")] for name in engines}
    for _ in range(args.repeats):
        for name, (generate, _) in engines.items():
            for slot, n in enumerate((1, args.new_tokens)):
                start = clock()
                generate(n)
                best[name][slot] = min(best[name][slot], clock() - start)
    return {
        name: (t1, batch * (args.new_tokens - 1) / (tn - t1), engines[name][1]()) for name, (t1, tn) in best.items()
    }


def bench_family(args, family: str, rows: list) -> None:
    model_parallel_cuda_manual_seed(1234)
    ours = build_ours(args, family)
    hf = build_hf(args, ours, family)
    error = check_same_model(ours, hf, args)
    params = sum(p.numel() for p in ours.parameters())
    tokenizer = NullTokenizer(args.vocab - 1)
    total_tokens = args.prompt + args.new_tokens
    d = args.hidden // args.heads
    kv_heads = args.heads if family == "gpt2" else args.kv_heads
    print(
        f"\n{family}: {params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"{kv_heads} KV heads, vocab {args.vocab}); HF logits match ours to {error:.1e}",
        flush=True,
    )

    def prompts(batch):
        g = torch.Generator().manual_seed(batch)
        return torch.randint(0, args.vocab - 1, (batch, args.prompt), generator=g)

    def greedy(n):
        return SamplingParams(top_k=1, num_tokens_to_generate=n, termination_id=-1)

    def make_dynamic(batch, model=ours):
        block = 16
        context = DynamicInferenceContext(
            torch.float32,
            args.layers,
            d,
            kv_heads,
            args.max_seq,
            block_size_tokens=block,
            num_blocks=batch * math.ceil(total_tokens / block),
            max_requests=batch,
            max_tokens=max(batch * args.prompt, batch),
        )
        wrapper = GPTInferenceWrapper(model, context)  # stores the linear weights column-major on CPU
        if model is not ours:  # the copy keeps the training layout, to show what the column-major weights gain
            for weight in model.parameters():
                weight.data = weight.data.contiguous()
        engine = DynamicInferenceEngine(TextGenerationController(wrapper, tokenizer), context)
        batch_prompts = prompts(batch).tolist()
        return (lambda n: engine.generate(batch_prompts, greedy(n))), context.kv_cache_bytes

    def make_static(batch):
        controller = TextGenerationController(GPTInferenceWrapper(ours), tokenizer)
        engine = StaticInferenceEngine(controller, max_batch_size=batch, legacy=True)
        text = [" ".join(map(str, p)) for p in prompts(batch).tolist()]
        # The static context allocates [prompt + new tokens, batch] per layer for each generate call.
        return (lambda n: engine.generate(prompts=text, sampling_params=greedy(n))), (
            lambda: 2 * args.layers * kv_heads * d * total_tokens * batch * 4
        )

    def make_hf(batch):
        ids = prompts(batch)
        mask = torch.ones_like(ids)
        state = {}

        def generate(n):
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                return_dict_in_generate=True,
                use_cache=True,
            )
            state["cache"] = out.past_key_values

        def kv_bytes():
            cache = state["cache"]
            tensors = []
            for layer in getattr(cache, "layers", []):
                tensors += [layer.keys, layer.values]
            if not tensors and hasattr(cache, "key_cache"):
                tensors = list(cache.key_cache) + list(cache.value_cache)
            return sum(t.numel() * t.element_size() for t in tensors)

        return generate, kv_bytes

    makers = [("ours dynamic", make_dynamic), ("ours static", make_static), ("HF generate", make_hf)]
    if args.compare_layouts:
        model_parallel_cuda_manual_seed(1234)
        row_major = build_ours(args, family)  # the same weights again
        makers.insert(1, ("dynamic, row-major", lambda batch: make_dynamic(batch, row_major)))
    with torch.inference_mode():
        for batch in args.batches:
            formula = 2 * args.layers * kv_heads * d * batch * total_tokens * 4
            for name, (ttft, tps, kv) in time_engines(makers, batch, args).items():
                rows.append(
                    {
                        "model": family,
                        "params": params,
                        "engine": name,
                        "batch": batch,
                        "ttft_ms": ttft * 1e3,
                        "decode_tok_s": tps,
                        "kv_bytes": kv,
                        "formula_bytes": formula,
                    }
                )
                print(
                    f"{name:>18} batch {batch:>3}: TTFT {ttft * 1e3:8.1f} ms   decode {tps:8.1f} tok/s   "
                    f"KV {kv / 2**20:6.2f} MiB (formula {formula / 2**20:6.2f} MiB)",
                    flush=True,
                )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads of the Llama model (GQA)")
    parser.add_argument("--vocab", type=int, default=12288)
    parser.add_argument("--max-seq", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--compare-layouts",
        action="store_true",
        help="also time the dynamic engine on a copy of the model whose linear weights keep the "
        "row-major training layout instead of the column-major one inference uses on CPU",
    )
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: this process's CPU time (with --threads 1 it is the compute time, and other jobs "
        "on a shared machine disturb it far less than wall time); wall: elapsed time",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(__file__).parent / "results" / "inference.json",
        help="where the results go as JSON (default benchmarks/results/inference.json)",
    )
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu sums the time of every thread; use it with --threads 1 (or --clock wall)")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    rows = []
    for family in args.models:
        bench_family(args, family, rows)
    print(
        f"\nprompt {args.prompt} + {args.new_tokens} new tokens, greedy, fp32, {args.threads} thread(s), "
        f"{args.clock} clock, best of {args.repeats}"
    )
    print("| model | engine | batch | TTFT (ms) | decode tokens/s | KV cache (MiB) | formula (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['engine']} | {r['batch']} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} | "
            f"{r['kv_bytes'] / 2**20:.2f} | {r['formula_bytes'] / 2**20:.2f} |"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
