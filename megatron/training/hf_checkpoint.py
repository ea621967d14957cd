"""``--load HF_DIR`` / ``--pretrained-checkpoint HF_DIR``: training starts from a Hugging Face model directory
without an on-disk conversion. ``--use-checkpoint-args`` takes the model flags from its ``config.json`` (the
arguments tools/checkpoint/convert.py would store); without it the command line's model flags must be the HF
model's. load_checkpoint then fills every rank's TP/PP shards in memory and training starts at iteration 0 with a
fresh optimizer (fine-tuning); ``--save`` writes ordinary Megatron checkpoints to resume from."""

import os
from typing import Optional

from megatron.training.flag_tables import flag_for
from megatron.core.dist_checkpointing.core import CheckpointingException

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def is_hugging_face_directory(path) -> bool:
    """A directory with an HF ``config.json`` and safetensors weights (one file, or shards with their index)."""
    return (
        path is not None
        and os.path.isfile(os.path.join(path, "config.json"))
        and any(os.path.isfile(os.path.join(path, name)) for name in _WEIGHT_FILES)
    )


def hugging_face_load_dir(args, load_arg: str = "load") -> Optional[str]:
    """The HF directory training starts from: ``args.<load_arg>`` when it is one, else ``--pretrained-checkpoint``
    when that is one (the caller has found no Megatron checkpoint in either), else None."""
    for path in (getattr(args, load_arg, None), getattr(args, "pretrained_checkpoint", None)):
        if is_hugging_face_directory(path):
            return path
    return None


def _settings(hf_dir: str):
    from megatron.core.models.huggingface.config import read_hf_config, settings_from_hf_config
    from megatron.core.models.huggingface.families import UnsupportedHFModelError

    try:
        return settings_from_hf_config(read_hf_config(hf_dir))[1]
    except UnsupportedHFModelError as error:
        raise CheckpointingException(f"--load {hf_dir}: {error}") from None


def hf_checkpoint_args(args, hf_dir: str):
    """The arguments a conversion of ``hf_dir`` at this run's layout would store (the tokenizer: the directory's
    own ``tokenizer.json``, when it has one)."""
    from megatron.core.models.huggingface.config import checkpoint_args_from_settings

    has_tokenizer = os.path.isfile(os.path.join(hf_dir, "tokenizer.json"))
    return checkpoint_args_from_settings(
        _settings(hf_dir),
        getattr(args, "tensor_model_parallel_size", 1) or 1,
        getattr(args, "pipeline_model_parallel_size", 1) or 1,
        getattr(args, "make_vocab_size_divisible_by", None) or 128,
        tokenizer_model=os.path.abspath(hf_dir) if has_tokenizer else None,
    )


def take_hf_model_args(args, hf_dir: str, names) -> None:
    """``--use-checkpoint-args`` for an HF directory: the model flags ``names`` from its config. The parallel
    layout stays the command line's (an HF model has none), and so does a tokenizer the command line names."""
    saved = hf_checkpoint_args(args, hf_dir)
    for name in names:
        if hasattr(saved, name):
            setattr(args, name, getattr(saved, name))
    if getattr(args, "tokenizer_model", None) is None and getattr(saved, "tokenizer_model", None) is not None:
        args.tokenizer_model = saved.tokenizer_model


# The model flags the HF model fixes (dropout, sequence length and tokenizer are the run's choice).
_MATCHED_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_base",
    "use_rope_scaling",
    "swiglu",
    "squared_relu",
    "openai_gelu",
    "untie_embeddings_and_output_weights",
    "normalization",
    "layernorm_epsilon",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "is_hybrid_model",
)
_HYBRID_ARGS = ("hybrid_layer_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")


def _run_value(args, name: str):
    value = getattr(args, name, None)
    if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
        return args.num_attention_heads  # without --group-query-attention every head is its own group
    if name == "kv_channels" and value is None and args.hidden_size and args.num_attention_heads:
        return args.hidden_size // args.num_attention_heads
    if name == "ffn_hidden_size" and value is None and args.hidden_size:
        return 4 * args.hidden_size
    if name in (
        "is_hybrid_model",
        "use_rope_scaling",
        "swiglu",
        "squared_relu",
        "openai_gelu",
        "untie_embeddings_and_output_weights",
        "add_qkv_bias",
        "qk_layernorm",
    ):
        return bool(value)
    return value


def check_args_match_hf(args, hf_dir: str) -> None:
    """Refuse, naming the flag, this run's value and the HF config's, a model that is not the HF model (run on
    every rank alike, before the load's first collective)."""
    expected = hf_checkpoint_args(args, hf_dir)
    expected.is_hybrid_model = bool(getattr(expected, "is_hybrid_model", False))
    names = list(_MATCHED_ARGS) + (list(_HYBRID_ARGS) if expected.is_hybrid_model else [])
    if expected.use_rope_scaling:
        names.append("rope_scaling_factor")
    differing = []
    for name in names:
        want, have = getattr(expected, name), _run_value(args, name)
        if want != have:
            differing.append(f"{flag_for(name)} is {have!r}, the HF config gives {want!r}")
    if differing:
        raise CheckpointingException(
            f"--load {hf_dir}: this run's model is not the Hugging Face model: "
            + "; ".join(differing)
            + " (pass --use-checkpoint-args to take the model flags from its config.json)"
        )


def load_hf_checkpoint(ddp_model, optimizer, hf_dir: str) -> None:
    """Fill the model chunks (this rank's TP/PP shards) from ``hf_dir``; the optimizer starts fresh, its fp32 main
    parameters (fp16/bf16 runs) copied from the loaded weights."""
    from megatron.core.models.huggingface import load_hf_weights
    from megatron.core.models.huggingface.families import UnsupportedHFModelError
    from megatron.core.utils import unwrap_model
    from megatron.training.global_vars import get_args
    from megatron.training.utils import print_rank_0

    args = get_args()
    check_args_match_hf(args, hf_dir)
    print_rank_0(
        f" loading the Hugging Face model {hf_dir} in memory (no conversion): fine-tuning from iteration 0 "
        "with a fresh optimizer and scheduler; --save writes Megatron checkpoints, resume from those"
    )
    chunks = unwrap_model(list(ddp_model))
    hybrid = _settings(hf_dir).hybrid_layer_pattern is not None
    built = {type(chunk).__name__ for chunk in chunks}
    if hybrid != (built == {"HybridModel"}):
        entry = "pretrain_hybrid.py" if hybrid else "pretrain_gpt.py"
        raise CheckpointingException(
            f"--load {hf_dir}: a {'hybrid' if hybrid else 'GPT'} model, this run built "
            f"{', '.join(sorted(built))}; train it with {entry}"
        )
    try:
        load_hf_weights(chunks, hf_dir)
    except UnsupportedHFModelError as error:
        raise CheckpointingException(f"--load {hf_dir}: {error}") from None
    if (args.fp16 or args.bf16) and optimizer is not None:
        optimizer.reload_model_params()
