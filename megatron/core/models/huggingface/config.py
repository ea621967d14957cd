"""An HF ``config.json`` as Megatron sees it: the :class:`ModelSettings`, the TransformerConfig and GPTModel
arguments built from them, the training arguments a converted checkpoint carries (so ``--use-checkpoint-args``
rebuilds the same model), and back: settings from a checkpoint's arguments, ``config.json`` from settings."""

import argparse
import json
import os
from types import SimpleNamespace
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.models.huggingface.families import (
    FamilyAdapter,
    ModelSettings,
    UnsupportedHFModelError,
    family_for_architecture,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise UnsupportedHFModelError(f"{hf_dir}: no config.json (is this a Hugging Face model directory?)")
    try:
        with open(path) as file:
            return json.load(file)
    except json.JSONDecodeError as error:
        raise UnsupportedHFModelError(f"{path} is not valid JSON ({error})") from None


def settings_from_hf_config(config: dict) -> Tuple[FamilyAdapter, ModelSettings]:
    """The family and Megatron settings of an HF config; refuses unknown architectures and unmapped values."""
    architectures = config.get("architectures") or [None]
    family = family_for_architecture(architectures[0])
    settings = family.settings_from_hf(config)
    if settings.params_dtype not in _DTYPES:
        raise UnsupportedHFModelError(
            f"{architectures[0]}: dtype = {settings.params_dtype!r} is not supported; use one of {sorted(_DTYPES)}"
        )
    if settings.num_attention_heads % settings.num_query_groups:
        raise UnsupportedHFModelError(
            f"{architectures[0]}: num_attention_heads ({settings.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({settings.num_query_groups})"
        )
    return family, settings


def torch_dtype(settings: ModelSettings) -> torch.dtype:
    return _DTYPES[settings.params_dtype]


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_parallel_size: int = 1) -> int:
    """The vocabulary Megatron builds for ``vocab_size`` tokens (``--make-vocab-size-divisible-by`` x TP)."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    options = SimpleNamespace(
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, tensor_model_parallel_size=tensor_parallel_size
    )
    return vocab_size_with_padding(vocab_size, options, logging_enabled=False)


def transformer_config_from_settings(settings: ModelSettings, **overrides):
    """The TransformerConfig of the model; ``overrides`` add the parallel layout and run settings
    (``tensor_model_parallel_size=2``, ``use_cpu_initialization=True``, ...)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu

    from megatron.core.activations import squared_relu

    if settings.squared_relu:
        activation = squared_relu
    elif settings.swiglu:
        activation = F.silu
    else:
        activation = openai_gelu if settings.openai_gelu else F.gelu
    kwargs = dict(
        num_layers=settings.num_layers,
        hidden_size=settings.hidden_size,
        ffn_hidden_size=settings.ffn_hidden_size,
        num_attention_heads=settings.num_attention_heads,
        num_query_groups=settings.num_query_groups,
        kv_channels=settings.kv_channels,
        normalization=settings.normalization,
        layernorm_epsilon=settings.layernorm_epsilon,
        gated_linear_unit=settings.swiglu,
        activation_func=activation,
        bias_activation_fusion=False,
        add_bias_linear=settings.add_bias_linear,
        add_qkv_bias=settings.add_qkv_bias,
        hidden_dropout=settings.hidden_dropout,
        attention_dropout=settings.attention_dropout,
        params_dtype=torch_dtype(settings),
        **_moe_config(settings),
    )
    if settings.hybrid_layer_pattern is not None:
        kwargs.update(
            is_hybrid_model=True,
            mamba_state_dim=settings.mamba_state_dim,
            mamba_head_dim=settings.mamba_head_dim,
            mamba_num_groups=settings.mamba_num_groups,
            mamba_num_heads=settings.mamba_num_heads,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _moe_config(settings: ModelSettings) -> dict:
    """The MoE fields of a model with experts: Megatron's default softmax-then-top-k router renormalises over the
    k chosen experts, as Mixtral does (``moe_router_pre_softmax=True`` would not)."""
    if not settings.num_moe_experts:
        return {}
    return dict(
        num_moe_experts=settings.num_moe_experts,
        moe_router_topk=settings.moe_router_topk,
        moe_ffn_hidden_size=settings.moe_ffn_hidden_size,
        moe_aux_loss_coeff=settings.moe_aux_loss_coeff,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="allgather",
    )


def gpt_model_kwargs(
    settings: ModelSettings, tensor_parallel_size: int = 1, make_vocab_size_divisible_by: int = 128
) -> dict:
    """GPTModel's arguments besides ``config`` (the local layer spec, padded vocabulary, positions, RoPE, ties)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=settings.num_moe_experts, normalization=settings.normalization
        ),
        vocab_size=padded_vocab_size(settings.vocab_size, make_vocab_size_divisible_by, tensor_parallel_size),
        max_sequence_length=settings.max_position_embeddings,
        share_embeddings_and_output_weights=not settings.untie_embeddings_and_output_weights,
        position_embedding_type=settings.position_embedding_type,
        rotary_base=_rotary_base(settings.rotary_base),
        rope_scaling=settings.use_rope_scaling,
        rope_scaling_factor=settings.rope_scaling_factor,
    )


def hybrid_model_kwargs(
    settings: ModelSettings, tensor_parallel_size: int = 1, make_vocab_size_divisible_by: int = 128
) -> dict:
    """HybridModel's arguments besides ``config`` (the local hybrid spec, the pattern, padded vocabulary, ties)."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    return dict(
        hybrid_stack_spec=hybrid_stack_spec,
        hybrid_layer_pattern=settings.hybrid_layer_pattern,
        vocab_size=padded_vocab_size(settings.vocab_size, make_vocab_size_divisible_by, tensor_parallel_size),
        max_sequence_length=settings.max_position_embeddings,
        share_embeddings_and_output_weights=not settings.untie_embeddings_and_output_weights,
        position_embedding_type=settings.position_embedding_type,
    )


def model_class_and_kwargs(
    settings: ModelSettings, tensor_parallel_size: int = 1, make_vocab_size_divisible_by: int = 128
):
    """(GPTModel or HybridModel, its arguments besides ``config``) for the settings."""
    if settings.hybrid_layer_pattern is not None:
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        return HybridModel, hybrid_model_kwargs(settings, tensor_parallel_size, make_vocab_size_divisible_by)
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel, gpt_model_kwargs(settings, tensor_parallel_size, make_vocab_size_divisible_by)


def _rotary_base(theta: float):
    return int(theta) if float(theta).is_integer() else theta


# ---- training arguments (what --use-checkpoint-args reads) --------------------------------------------------------


def checkpoint_args_from_settings(
    settings: ModelSettings,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    make_vocab_size_divisible_by: int,
    tokenizer_model: Optional[str] = None,
):
    """The ``args`` Namespace of a converted checkpoint: Megatron-LM's argument names for the model flags."""
    args = argparse.Namespace(
        num_layers=settings.num_layers,
        hidden_size=settings.hidden_size,
        ffn_hidden_size=settings.ffn_hidden_size,
        num_attention_heads=settings.num_attention_heads,
        num_query_groups=settings.num_query_groups,
        group_query_attention=settings.num_query_groups != settings.num_attention_heads,
        kv_channels=settings.kv_channels,
        max_position_embeddings=settings.max_position_embeddings,
        seq_length=settings.max_position_embeddings,
        position_embedding_type=settings.position_embedding_type,
        rotary_base=_rotary_base(settings.rotary_base),
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=settings.use_rope_scaling,
        rope_scaling_factor=settings.rope_scaling_factor,
        swiglu=settings.swiglu,
        openai_gelu=settings.openai_gelu,
        squared_relu=False,
        untie_embeddings_and_output_weights=settings.untie_embeddings_and_output_weights,
        normalization=settings.normalization,
        layernorm_epsilon=settings.layernorm_epsilon,
        add_bias_linear=settings.add_bias_linear,
        add_qkv_bias=settings.add_qkv_bias,
        qk_layernorm=False,
        apply_query_key_layer_scaling=False,
        hidden_dropout=settings.hidden_dropout,
        attention_dropout=settings.attention_dropout,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size(settings.vocab_size, make_vocab_size_divisible_by, tensor_parallel_size),
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=None,
        params_dtype=_DTYPES[settings.params_dtype],
        bf16=settings.params_dtype == "bfloat16",
        fp16=settings.params_dtype == "float16",
        ckpt_format="torch_dist",
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        hf_vocab_size=settings.vocab_size,
    )
    if settings.hybrid_layer_pattern is not None:
        args.is_hybrid_model, args.hybrid_layer_pattern = True, settings.hybrid_layer_pattern
        args.mamba_state_dim, args.mamba_head_dim = settings.mamba_state_dim, settings.mamba_head_dim
        args.mamba_num_groups, args.mamba_num_heads = settings.mamba_num_groups, settings.mamba_num_heads
        args.squared_relu = settings.squared_relu
    if settings.num_moe_experts:
        moe = _moe_config(settings)
        moe["num_experts"] = moe.pop("num_moe_experts")
        vars(args).update(
            moe, moe_grouped_gemm=False, moe_shared_expert_intermediate_size=None, moe_router_topk_scaling_factor=None
        )
    if tokenizer_model is not None:
        args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", tokenizer_model
    return args


def settings_from_checkpoint_args(args, true_vocab_size: Optional[int] = None) -> ModelSettings:
    """The model settings of a Megatron checkpoint's saved arguments (converted here or trained with Megatron);
    ``true_vocab_size`` (``--true-vocab-size``) is the vocabulary without Megatron's padding, by default the one
    the checkpoint records or its tokenizer's."""
    missing = [
        name
        for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")
        if getattr(args, name, None) is None
    ]
    if missing:
        raise UnsupportedHFModelError(f"the checkpoint's arguments lack {missing}; it cannot be exported")
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    swiglu = bool(getattr(args, "swiglu", False))
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * args.hidden_size
    vocab = true_vocab_size or getattr(args, "hf_vocab_size", None) or _unpadded_vocab(args)
    dtype = "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else "float32"
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is None and getattr(args, "is_hybrid_model", False):
        pattern = "M" * args.num_layers  # --is-hybrid-model without a pattern: all Mamba layers
    hybrid = {}
    if pattern is not None:
        hybrid = dict(
            hybrid_layer_pattern=pattern.replace("|", ""), squared_relu=bool(getattr(args, "squared_relu", False))
        )
        for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"):
            hybrid[name] = getattr(args, name)
        if hybrid["mamba_num_heads"] is None:  # Megatron's default: d_inner = 2 * hidden
            hybrid["mamba_num_heads"] = 2 * args.hidden_size // args.mamba_head_dim
        if not hybrid["squared_relu"] and "-" in pattern:
            raise UnsupportedHFModelError(
                "the checkpoint's hybrid has MLP layers without --squared-relu; NemotronH's MLP layers use squared ReLU"
            )
    unsupported = {
        "squared_relu": bool(hybrid.get("squared_relu", False)),
        "qk_layernorm": False,
        "rotary_interleaved": False,
        "apply_layernorm_1p": False,  # the dest of --apply-layernorm-1p in older Megatron-LM
        "layernorm_zero_centered_gamma": False,  # and since
        "moe_router_pre_softmax": False,
        "moe_router_score_function": "softmax",
        "moe_router_topk_scaling_factor": None,
        "moe_shared_expert_intermediate_size": None,
        "moe_router_enable_expert_bias": False,
        "moe_input_jitter_eps": None,
    }
    for name, expected in unsupported.items():
        if getattr(args, name, expected) not in (expected, 0 if expected is None else expected):
            raise UnsupportedHFModelError(
                f"the checkpoint's model uses {name}={getattr(args, name)!r}, which no "
                "supported Hugging Face family has"
            )
    if float(getattr(args, "rotary_percent", 1.0)) != 1.0:
        raise UnsupportedHFModelError(f"rotary_percent={args.rotary_percent} has no mapping in the supported families")
    return ModelSettings(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=getattr(args, "kv_channels", None) or args.hidden_size // heads,
        vocab_size=vocab,
        max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        swiglu=swiglu,
        openai_gelu=bool(getattr(args, "openai_gelu", 0)),
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        rotary_base=float(getattr(args, "rotary_base", 10000)),
        use_rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(getattr(args, "rope_scaling_factor", 8.0)),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        params_dtype=dtype,
        **hybrid,
        **_moe_settings_from_args(args, ffn),
    )


def _moe_settings_from_args(args, ffn_hidden_size: int) -> dict:
    experts = getattr(args, "num_experts", None)
    if not experts:
        return {}
    # Grouped-GEMM experts are stored under the per-expert keys (mlp.experts.experts.linear_fc1.weight), as in
    # Megatron, so export reads them like those of --moe-grouped-gemm off.
    return dict(
        num_moe_experts=experts,
        moe_router_topk=getattr(args, "moe_router_topk", 2),
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or ffn_hidden_size,
        moe_aux_loss_coeff=float(getattr(args, "moe_aux_loss_coeff", 0.0) or 0.0),
    )


def _unpadded_vocab(args) -> int:
    """The vocabulary of the tokenizer the checkpoint's run used (a fine-tuning run's arguments no longer say the
    HF vocabulary); without a tokenizer that can be built here, the padded size (padding rows exported as tokens)."""
    import logging

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    if getattr(args, "tokenizer_type", None) is not None:
        try:
            return build_tokenizer(argparse.Namespace(**{**vars(args), "padded_vocab_size": 0})).vocab_size
        except (ValueError, OSError) as error:
            reason = f"its tokenizer cannot be built here ({error})"
    else:
        reason = "it names no tokenizer"
    size = getattr(args, "padded_vocab_size", None)
    if size is None:
        raise UnsupportedHFModelError("the checkpoint's arguments have no padded_vocab_size; pass --true-vocab-size")
    logging.getLogger(__name__).warning(
        "the checkpoint does not record its unpadded vocabulary and %s: exporting all %d rows; pass "
        "--true-vocab-size to drop the padding",
        reason,
        size,
    )
    return size


def hf_config_for_export(family: FamilyAdapter, settings: ModelSettings, source_config: Optional[dict]) -> dict:
    """``config.json`` for the exported model: the family's mapping of the settings, over the source config's
    other entries (token ids, initializer range, ...) when the checkpoint was converted from one."""
    config = dict(source_config or {})
    config.update(family.hf_config_from_settings(settings))
    return config
