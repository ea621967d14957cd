"""Pretrain a hybrid Mamba / attention / MLP model (Megatron-LM's entry point, same flags).

    torchrun --nproc_per_node 2 pretrain_hybrid.py --tensor-model-parallel-size 2 \\
        --hybrid-layer-pattern "M*-M-" --hidden-size 256 --num-attention-heads 8 \\
        --mamba-state-dim 64 --mamba-head-dim 32 --mamba-num-groups 2 --position-embedding-type none \\
        --seq-length 256 --micro-batch-size 4 --global-batch-size 16 --train-iters 100 --lr 3e-4 --data-path <prefix>

The layer pattern sets the number of layers (``--num-layers`` may be left out) and, with ``|``, the pipeline stages.
Everything but the model (data, loss, the training loop, checkpoints) is pretrain_gpt.py's.
examples/mamba/train_hybrid_cpu.sh runs it on 2 CPU ranks with the built-in corpus.
"""

import pretrain_gpt
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.spec_utils import import_module
from megatron.training import get_args, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args


def stack_spec_from_args(args, default):
    """The stack spec named by ``--spec <module> <name>`` (e.g. ``megatron.core.models.mamba.mamba_layer_specs
    mamba_stack_spec``), else ``default``."""
    if not args.spec:
        return default
    if len(args.spec) != 2:
        raise ValueError(f"--spec takes a module and the name of a stack spec in it, got {' '.join(args.spec)!r}")
    return import_module(tuple(args.spec))


def build_hybrid_model(
    model_class,
    spec_keyword: str,
    default_spec,
    pre_process: bool,
    post_process: bool,
    vp_stage=None,
    config=None,
    pg_collection=None,
):
    """``model_class(config, <spec_keyword>=stack spec, ...)`` for this pipeline stage from the flags."""
    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    if args.transformer_impl == "transformer_engine":
        print_rank_0("WARNING: Transformer Engine specs are not available; using the local hybrid spec")
    return model_class(
        config=config,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
        **{spec_keyword: stack_spec_from_args(args, default_spec)},
    )


def model_provider(
    pre_process: bool = True, post_process: bool = True, vp_stage=None, config=None, pg_collection=None
) -> HybridModel:
    """A HybridModel for this pipeline stage from ``hybrid_stack_spec`` (or ``--spec``)."""
    return build_hybrid_model(
        HybridModel, "hybrid_stack_spec", hybrid_stack_spec, pre_process, post_process, vp_stage, config, pg_collection
    )


def hybrid_model_flags(parser):
    """These scripts always train a hybrid: ``--is-hybrid-model`` is on (all Mamba without a pattern)."""
    parser.set_defaults(is_hybrid_model=True)
    return parser


if __name__ == "__main__":
    from functools import partial

    from megatron.training.error_handling import tool_main

    tool_main(partial(pretrain_gpt.main, model_provider_func=model_provider, extra_args_provider=hybrid_model_flags))
