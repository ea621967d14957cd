"""Config containers from parsed arguments (Megatron-LM 0.19's bridge from the flag world to the config API):
``pretrain_cfg_container_from_args`` and the model configs of ``gpt_config_from_args`` /
``hybrid_config_from_args``. Importable from ``megatron.training.argument_utils`` too, Megatron-LM's path."""

import dataclasses
import warnings
from typing import Any

from megatron.training import config as cfg
from megatron.training.models import GPTModelConfig, HybridModelConfig


def _default_config_from_args(cls: type, args, return_instance: bool = True) -> Any:
    """``cls`` (or, with ``return_instance=False``, its keyword arguments) from the arguments named like its
    fields; fields without an argument keep their defaults."""
    kwargs = {field.name: getattr(args, field.name) for field in dataclasses.fields(cls) if hasattr(args, field.name)}
    return cls(**kwargs) if return_instance else kwargs


def _checkpoint_and_profiling_configs(args):
    """CheckpointConfig and ProfilingConfig: the fields whose flag is negated or renamed
    (``--no-save-optim`` -> ``save_optim``, ``--ckpt-fully-parallel-save`` -> ``fully_parallel_save``,
    ``--profile`` -> ``use_nsys_profiler``), the rest by name."""
    checkpoint = _default_config_from_args(cfg.CheckpointConfig, args, return_instance=False)
    for name in ("save_optim", "save_rng", "load_optim", "load_rng"):
        checkpoint[name] = not getattr(args, f"no_{name}")
    checkpoint["fully_parallel_save"] = args.ckpt_fully_parallel_save
    checkpoint["fully_parallel_load"] = args.ckpt_fully_parallel_load
    profiling = _default_config_from_args(cfg.ProfilingConfig, args, return_instance=False)
    profiling["use_nsys_profiler"] = args.profile
    return cfg.CheckpointConfig(**checkpoint), cfg.ProfilingConfig(**profiling)


def pretrain_cfg_container_from_args(args, model_cfg=None):
    """The PretrainConfigContainer of parsed arguments: every config read by field name, the optimizer and DDP
    configs from ``megatron.training.training``'s ``get_megatron_optimizer_config`` / ``get_megatron_ddp_config``,
    ``model_cfg`` as the model (a ``GPTModelConfig`` / ``HybridModelConfig``; None warns, as Megatron-LM does)."""
    # Looked up at call time: the run's helpers live in megatron.training.training (and tests patch them there).
    from megatron.training import training

    if model_cfg is None:
        warnings.warn(
            "pretrain_cfg_container_from_args without model_cfg: pass a ModelConfig "
            "(megatron.training.models.GPTModelConfig or HybridModelConfig) rather than a model provider function",
            stacklevel=2,
        )
    checkpoint, profiling = _checkpoint_and_profiling_configs(args)
    rerun = _default_config_from_args(cfg.RerunStateMachineConfig, args, return_instance=False)
    rerun["check_for_nan_in_loss"] = args.check_for_nan_in_loss_and_grad
    optimizer = training.get_megatron_optimizer_config(args)
    if isinstance(optimizer, tuple):  # Megatron-LM's version returns (config, per-parameter overrides)
        optimizer = optimizer[0]
    return cfg.PretrainConfigContainer(
        train=_default_config_from_args(cfg.TrainingConfig, args),
        validation=_default_config_from_args(cfg.ValidationConfig, args),
        model=model_cfg,
        optimizer=optimizer,
        scheduler=_default_config_from_args(cfg.SchedulerConfig, args),
        ddp=training.get_megatron_ddp_config(args),
        dist=_default_config_from_args(cfg.DistributedInitConfig, args),
        rng=_default_config_from_args(cfg.RNGConfig, args),
        logger=_default_config_from_args(cfg.LoggerConfig, args),
        checkpoint=checkpoint,
        profiling=profiling,
        tokenizer=_default_config_from_args(cfg.TokenizerConfig, args),
        rerun_state_machine=cfg.RerunStateMachineConfig(**rerun),
        straggler=_default_config_from_args(cfg.StragglerDetectionConfig, args),
    )


def _model_config_kwargs(args, transformer) -> dict:
    """The settings GPT and hybrid model configs share, from their Megatron-LM flags."""
    if args.padded_vocab_size is not None:  # the exact size, e.g. of a third-party checkpoint: no more padding
        vocab_size, should_pad = args.padded_vocab_size, False
    elif args.vocab_size is not None:
        vocab_size, should_pad = args.vocab_size, True
    else:
        raise ValueError(
            "a model config needs the vocabulary size: give --vocab-size (padded for tensor parallelism) "
            "or --padded-vocab-size (used as it is)"
        )
    return {
        "transformer": transformer,
        "fp16_lm_cross_entropy": args.fp16_lm_cross_entropy,
        "position_embedding_type": args.position_embedding_type,
        "rotary_percent": args.rotary_percent,
        "rotary_base": args.rotary_base,
        "make_vocab_size_divisible_by": args.make_vocab_size_divisible_by,
        "seq_len_interpolation_factor": args.rotary_seq_len_interpolation_factor,
        "seq_length": args.max_position_embeddings,
        "share_embeddings_and_output_weights": not args.untie_embeddings_and_output_weights,
        "vocab_size": vocab_size,
        "should_pad_vocab": should_pad,
    }


def _check_model_config_class(model_config_cls: type, base: type) -> None:
    if not (isinstance(model_config_cls, type) and issubclass(model_config_cls, base)):
        raise TypeError(f"model_config_cls must be {base.__name__} or a subclass of it, got {model_config_cls!r}")


def gpt_config_from_args(args, config=None, model_config_cls: type = GPTModelConfig):
    """The GPTModelConfig (or ``model_config_cls``, a subclass adding no fields) of parsed arguments; ``config``
    (a TransformerConfig) replaces the one built from the flags (or from ``--yaml-cfg``)."""
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training.argument_utils import core_transformer_config_from_args

    _check_model_config_class(model_config_cls, GPTModelConfig)
    if config is None:
        if args.yaml_cfg is not None:
            from megatron.training.yaml_arguments import core_transformer_config_from_yaml

            config = core_transformer_config_from_yaml(args, "language_model")
        else:
            config = core_transformer_config_from_args(args)
    kwargs = _model_config_kwargs(args, config)
    kwargs["rope_scaling"] = args.use_rope_scaling
    if args.spec is not None:
        kwargs["transformer_layer_spec"] = import_module(args.spec)
    return model_config_cls(**kwargs)


def hybrid_config_from_args(args, config=None, model_config_cls: type = HybridModelConfig):
    """The HybridModelConfig (or ``model_config_cls``, a subclass adding no fields) of parsed arguments, the layer
    mix from ``--hybrid-layer-pattern``; ``config`` (a TransformerConfig) replaces the one built from the flags."""
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training.argument_utils import core_transformer_config_from_args

    _check_model_config_class(model_config_cls, HybridModelConfig)
    config = core_transformer_config_from_args(args) if config is None else config
    kwargs = _model_config_kwargs(args, config)
    kwargs["hybrid_layer_pattern"] = args.hybrid_layer_pattern
    if args.spec is not None:
        kwargs["hybrid_stack_spec"] = import_module(args.spec)
    return model_config_cls(**kwargs)


def inference_cfg_from_args(args) -> cfg.InferenceSetupConfig:
    """The InferenceSetupConfig of parsed arguments (its fields are the inference flags' names)."""
    return _default_config_from_args(cfg.InferenceSetupConfig, args)


def inference_cfg_container_from_args(args, model_cfg=None) -> cfg.InferenceConfigContainer:
    """What an inference entry point needs from parsed arguments: the model config (built from the flags when
    ``model_cfg`` is None: hybrid with ``--hybrid-layer-pattern``, else GPT), checkpoint, inference, distributed,
    RNG, tokenizer, logging and profiling configs."""
    if model_cfg is None:
        if getattr(args, "hybrid_layer_pattern", None) is not None:
            model_cfg = hybrid_config_from_args(args)
        else:
            model_cfg = gpt_config_from_args(args)
    checkpoint, profiling = _checkpoint_and_profiling_configs(args)
    return cfg.InferenceConfigContainer(
        model=model_cfg,
        checkpoint=checkpoint,
        inference=inference_cfg_from_args(args),
        dist=_default_config_from_args(cfg.DistributedInitConfig, args),
        rng=_default_config_from_args(cfg.RNGConfig, args),
        tokenizer=_default_config_from_args(cfg.TokenizerConfig, args),
        logger=_default_config_from_args(cfg.LoggerConfig, args),
        profiling=profiling,
    )
