"""Pretrain a GPT model (Megatron-LM's entry point, same flags).

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 \\
        --micro-batch-size 4 --global-batch-size 16 --train-iters 100 --lr 3e-4 --data-path <prefix> ...

examples/cpu/train_gpt_cpu.sh runs it on 4 CPU ranks with the built-in Shakespeare corpus and tokenizer.
"""

from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.context_parallel.batch import get_batch_on_this_cp_rank
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.arguments import (
    core_gpt_dataset_config_from_args,
    core_transformer_config_from_args,
    parse_and_validate_args,
)
from megatron.training.error_handling import exit_on_error
from megatron.training.utils import get_batch_on_this_tp_rank


def model_provider(
    pre_process: bool = True, post_process: bool = True, vp_stage=None, config=None, pg_collection=None
) -> GPTModel:
    """A GPTModel for this pipeline stage from the layer spec ``--transformer-impl`` names: the local (pure
    PyTorch) spec, or ``transformer_engine``'s, built here from the same PyTorch modules in Transformer Engine's
    checkpoint layout; with ``--num-experts`` the decoder block spec of dense and MoE layers. ``config`` (a
    TransformerConfig) defaults to the flags', ``pg_collection`` to parallel_state's groups."""
    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        # MoE: one spec per layer, dense or MoE as --moe-layer-freq says (Megatron-LM's model_provider does this).
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization, vp_stage=vp_stage
        )
    elif use_te:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token loss: the sum and the token count, so the schedule can average over the whole batch (with
    context parallelism both are this CP rank's share; the schedule, the gradient reduction over data x context
    ranks and the logged loss, reduced over the same group, make the totals)."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": reporting_loss}


def get_batch(data_iterator, vp_stage=None):
    """``(tokens, labels, loss_mask, attention_mask, position_ids)`` of the next micro-batch on this rank: read on
    TP rank 0 and broadcast to the other TP ranks, then cut to this context-parallel rank's load-balanced chunks of
    the sequence (every CP rank of a data-parallel replica reads the same sample)."""
    del vp_stage  # the stage is read from parallel_state, which the schedules keep current
    batch = get_batch_on_this_cp_rank(get_batch_on_this_tp_rank(data_iterator), is_hybrid_cp=False)
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"]


def forward_step(data_iterator, model: GPTModel):
    """One micro-batch: read, forward, and the loss function to apply."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank() -> bool:
    return (
        parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        or parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    ) and parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Blended GPT datasets from --data-path / per-split paths, or the mock dataset with --mock-data."""
    args = get_args()
    config = core_gpt_dataset_config_from_args(args, get_tokenizer())
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, is_dataset_built_on_rank, config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


train_valid_test_datasets_provider.is_distributed = True


def main(forward_step_func=forward_step, model_provider_func=model_provider, extra_args_provider=None) -> None:
    """Parse the command line and train. Scripts that wrap this one pass their own forward step, model provider
    (pretrain_hybrid.py) or extra flags / flag defaults (``extra_args_provider(parser)``)."""
    with exit_on_error():  # a bad flag or input is reported once for the job, not once per rank
        args = parse_and_validate_args(extra_args_provider=extra_args_provider)
    pretrain(
        args,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step_func,
        model_provider=model_provider_func,
    )


if __name__ == "__main__":
    from megatron.training.error_handling import tool_main

    tool_main(main)
