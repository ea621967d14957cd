"""Megatron-Core used directly as a library: a small GPT trained with tensor parallelism on CPU or GPU.

    torchrun --nproc_per_node 2 examples/run_simple_mcore_train_loop.py            # TP=2 on the built-in corpus
    torchrun --nproc_per_node 4 examples/run_simple_mcore_train_loop.py --tp 2     # TP=2 x DP=2
    python examples/run_simple_mcore_train_loop.py --tp 1 --mock-data              # one process, synthetic tokens

It initialises torch.distributed (gloo on CPU, nccl on GPU) and the model-parallel groups, builds a GPTModel from
the local layer spec, reads samples of the built-in Shakespeare corpus (already tokenized, shipped with the package)
through GPTDataset, and trains with a plain torch optimizer, averaging gradients over data-parallel ranks by hand.
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tokenizers import vocab_size_with_padding
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import default_backend, get_current_device, print_rank_0, set_device_for_rank
from megatron.training import builtin_data


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-model-parallel size")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--mock-data", action="store_true", help="synthetic tokens instead of the built-in corpus")
    return parser.parse_args()


def initialize(tp: int, seed: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # also runnable as a plain single process
    os.environ.setdefault("MASTER_PORT", "29500")
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    set_device_for_rank(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(default_backend(), rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)


def build_dataset(args, tokenizer):
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else ([builtin_data.data_prefix()], None),
        split="969,30,1",
        path_to_cache=os.path.join(tempfile.gettempdir(), "megatron-lite-example-cache"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mock=args.mock_data,
    )
    dp_size = parallel_state.get_data_parallel_world_size()
    num_samples = args.steps * args.micro_batch_size * dp_size
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(dataset_class, [num_samples, 0, 0], lambda: True, config).build()
    return train


def get_batch(dataset, step: int, micro_batch_size: int):
    """This data-parallel rank's slice of the step's global batch, in the global sample order."""
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    first = (step * dp_size + dp_rank) * micro_batch_size
    samples = [dataset[i] for i in range(first, first + micro_batch_size)]
    device = get_current_device()
    return {
        key: torch.stack([s[key] for s in samples]).to(device)
        for key in ("tokens", "labels", "loss_mask", "position_ids")
    }


def average_gradients_over_data_parallel(model: torch.nn.Module) -> None:
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    for param in model.parameters():
        dist.all_reduce(param.grad, group=group)
        param.grad /= dist.get_world_size(group)


def main():
    args = parse_args()
    initialize(args.tp, args.seed)
    tokenizer = builtin_data.build_tokenizer()
    padded_vocab = vocab_size_with_padding(
        tokenizer.vocab_size,
        argparse.Namespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=args.tp, rank=dist.get_rank()),
    )
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=args.tp,
        sequence_parallel=args.sequence_parallel,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=padded_vocab,
        max_sequence_length=args.seq_length,
        share_embeddings_and_output_weights=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    dataset = build_dataset(args, tokenizer)
    print_rank_0(
        f"GPTModel: {sum(p.numel() for p in model.parameters()):,} parameters per rank, TP={args.tp}, "
        f"DP={parallel_state.get_data_parallel_world_size()}, {len(dataset):,} training samples of "
        f"{args.seq_length} tokens ({'synthetic' if args.mock_data else 'built-in Shakespeare corpus'})"
    )

    for step in range(args.steps):
        start = time.perf_counter()
        batch = get_batch(dataset, step, args.micro_batch_size)
        losses = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
        loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # Sums the gradients that are partial per TP rank (norms under sequence parallelism, q/k norms) and keeps
        # tied embeddings in sync; data-parallel averaging is done by hand here (DDP would do it in buckets).
        finalize_model_grads([model])
        average_gradients_over_data_parallel(model)
        optimizer.step()
        if (step + 1) % args.log_interval == 0 or step == 0:
            reported = loss.detach().clone()
            dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
            reported /= parallel_state.get_data_parallel_world_size()
            print_rank_0(f"step {step + 1:4d} | loss {reported.item():.4f} | {time.perf_counter() - start:.3f} s")

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
