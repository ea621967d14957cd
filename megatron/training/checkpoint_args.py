"""The arguments a training checkpoint carries: ``--use-checkpoint-args`` takes the model-defining ones from it, and
a checkpoint saved for another model is refused. Kept apart from ``checkpointing`` so that ``arguments`` can use it
without importing the save/load machinery.
"""

from megatron.core.public_api import public_api
from megatron.core.dist_checkpointing.checkpoint_dir import (
    checkpoint_exists,
    find_checkpoint_to_load,
    get_checkpoint_tracker_filename,
    legacy_rank_0_file,
)
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.checksums import safe_torch_load_verified, verification
from megatron.training.hf_checkpoint import hugging_face_load_dir, take_hf_model_args


@public_api("megatron.training.checkpointing")
def get_load_checkpoint_path_by_args(args, load_arg="load"):
    """The directory to load from: ``args.<load_arg>`` when it holds a checkpoint; else ``--pretrained-checkpoint``
    when that does; else ``args.<load_arg>`` (nothing to resume)."""
    load_dir = getattr(args, load_arg)
    if checkpoint_exists(load_dir):
        return load_dir
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained is not None and checkpoint_exists(pretrained):
        return pretrained
    return load_dir


# Model-defining arguments that --use-checkpoint-args takes from the checkpoint (Megatron-LM's list, for what exists;
# the padded vocabulary size follows from vocab_size and make_vocab_size_divisible_by when the tokenizer is built).
_CHECKPOINT_MODEL_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "seq_length",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "use_rope_scaling",
    "rope_scaling_factor",
    "swiglu",
    "squared_relu",
    "openai_gelu",
    "untie_embeddings_and_output_weights",
    "normalization",
    "layernorm_epsilon",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "apply_query_key_layer_scaling",
    "hidden_dropout",
    "attention_dropout",
    "tokenizer_type",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "is_hybrid_model",
    "hybrid_layer_pattern",
    "mamba_state_dim",
    "mamba_head_dim",
    "mamba_num_groups",
    "mamba_num_heads",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_grouped_gemm",
)


# The layout, taken as well only with --use-mp-args-from-checkpoint-args (as in Megatron-LM): otherwise the command
# line's layout holds and the checkpoint is resharded on load.
_CHECKPOINT_PARALLEL_ARGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_virtual_stages_per_pipeline_rank",
    "num_layers_per_virtual_pipeline_stage",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
)


# What a checkpoint's model must share with this run's to load at all (the layout may differ: it reshards).
_CHECKED_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "position_embedding_type",
    "max_position_embeddings",
    "make_vocab_size_divisible_by",
    "padded_vocab_size",
)


@public_api("megatron.training.checkpointing")
def check_checkpoint_args(checkpoint_args, skip_args: set[str] | None = None):
    """Refuse, naming each argument, a checkpoint whose model shape differs from this run's (those in
    ``skip_args`` are not compared; arguments either side lacks are skipped)."""
    from megatron.training.global_vars import get_args

    args = get_args()
    skip_args = skip_args or set()
    differing = [
        f"{name}: checkpoint {getattr(checkpoint_args, name)!r}, this run {getattr(args, name)!r}"
        for name in _CHECKED_ARGS
        if name not in skip_args
        and hasattr(checkpoint_args, name)
        and hasattr(args, name)
        and getattr(checkpoint_args, name) != getattr(args, name)
    ]
    if differing:
        raise CheckpointingException("the checkpoint was saved for another model: " + "; ".join(differing))


@public_api("megatron.training.checkpointing")
def load_args_from_checkpoint(args, load_arg="load", checkpointing_context=None):
    """``--use-checkpoint-args``: set the model-defining arguments from the checkpoint's saved arguments (of
    ``--load``, or of ``--pretrained-checkpoint`` when ``--load`` holds none).

    Called before validation, on every rank (each reads the small common state). Values the checkpoint lacks keep
    their command-line values. Raises, naming the directory, when there is no checkpoint to take them from.
    ``checkpointing_context`` serves Megatron's node-local checkpoints, which are not part of this project: the
    arguments always come from the global checkpoint.
    """
    with verification(getattr(args, "ckpt_verify", True)):
        return _load_args_from_checkpoint(args, load_arg)


def _load_args_from_checkpoint(args, load_arg):
    from megatron.core.dist_checkpointing import load_common_state_dict

    # --load when it holds a checkpoint, else --pretrained-checkpoint (what load_checkpoint will load).
    load_dir = get_load_checkpoint_path_by_args(args, load_arg)
    found = find_checkpoint_to_load(load_dir, getattr(args, "ckpt_step", None)) if load_dir else None
    names = _CHECKPOINT_MODEL_ARGS
    if found is None and hugging_face_load_dir(args, load_arg) is not None:
        take_hf_model_args(args, hugging_face_load_dir(args, load_arg), names)  # the layout stays the run's
        return args
    if found is None:
        raise CheckpointingException(
            f"--use-checkpoint-args: no checkpoint to take the arguments from in {load_dir} "
            f"({get_checkpoint_tracker_filename(load_dir) if load_dir else '--load not given'})"
        )
    legacy_file = legacy_rank_0_file(found[0])  # a legacy checkpoint's arguments are in every rank's file
    if legacy_file is not None:
        saved = safe_torch_load_verified(legacy_file, f"legacy checkpoint file {legacy_file}").get("args")
    else:
        saved = load_common_state_dict(found[0]).get("args")
    if saved is None:
        raise CheckpointingException(f"--use-checkpoint-args: checkpoint {found[0]} holds no saved arguments")
    if getattr(args, "use_mp_args_from_checkpoint_args", False):
        names += _CHECKPOINT_PARALLEL_ARGS
    for name in names:
        if hasattr(saved, name):
            setattr(args, name, getattr(saved, name))
    return args
