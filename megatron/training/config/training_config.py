"""The training-side config dataclasses of a ``PretrainConfigContainer``: training loop, validation, schedules,
logging, checkpointing and tokenizer settings.

Field names, types and defaults are Megatron-LM 0.19's, which are the ``dest`` names of its command-line
arguments, so a field means what the flag of the same name means (see ``megatron.training.arguments``).
"""

import signal
from dataclasses import dataclass, field
from typing import Literal

from megatron.training.utils import has_nvrx_checkpointing_async_support


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes, run length, exit conditions and garbage collection of the training loop.

    Each field is the Megatron-LM argument of the same name (``micro_batch_size`` is ``--micro-batch-size``);
    the run length is given either in iterations (``train_iters``) or in samples (``train_samples``).
    """

    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    rampup_batch_size: list[int] | None = None
    step_batch_size_schedule: str | None = None
    decrease_batch_size_if_needed: bool = False
    empty_unused_memory_level: Literal[0, 1, 2] = 0
    check_weight_hash_across_dp_replicas_interval: int | None = None
    gpu_sniff_test_interval: int | None = None
    train_sync_interval: int | None = None
    train_iters: int | None = None
    train_samples: int | None = None
    exit_interval: int | None = None
    exit_duration_in_mins: int | None = None
    exit_signal_handler: bool = False
    exit_signal: signal.Signals = signal.SIGTERM
    exit_signal_handler_for_dataloader: bool = False
    exit_signal_handler_for_training: bool = False
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True
    iterations_to_skip: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class ValidationConfig:
    """How often and on how much data the model is evaluated (``--eval-iters``, ``--eval-interval``, ...)."""

    eval_iters: int | None = 100
    eval_interval: int | None = None
    start_eval_at_iter: int | None = None
    eval_global_batch_size: int | None = None
    eval_micro_batch_size: int | None = None
    skip_train: bool = False
    test_mode: bool = False
    full_validation: bool = False
    multiple_validation_sets: bool = False
    validation_set_names: list[str] | None = None


@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate and weight-decay schedules (the ``--lr-*`` and ``--*-weight-decay`` arguments).

    ``lr_decay_steps``, ``lr_warmup_steps``, ``wd_incr_steps`` and ``wsd_decay_steps`` are not settings: they are
    filled in (in samples or iterations) when the scheduler is built, so they are ``init=False`` and dropped from
    saved configs when read back.
    """

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    lr_warmup_fraction: float | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_steps: int | None = field(default=None, init=False)
    lr_warmup_steps: int | None = field(default=None, init=False)
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    no_weight_decay_cond_type: Literal["qwen3_next"] | None = None
    wd_incr_steps: int | None = field(default=None, init=False)
    wsd_decay_steps: int | None = field(default=None, init=False)


@dataclass(kw_only=True)
class LoggerConfig:
    """What the training loop logs, how often, and where (console, TensorBoard, Weights & Biases)."""

    log_interval: int = 100
    log_params_norm: bool = False
    log_throughput: bool = False
    log_throughput_to_tensorboard: bool = False
    throughput_window_size: int = 100
    log_progress: bool = False
    timing_log_level: Literal[0, 1, 2] = 0
    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    memory_keys: dict[str, str] | None = None
    log_memory_interval: int | None = None
    log_device_memory_used: bool = False
    log_l2_norm_grad_to_tensorboard: bool = False
    log_num_zeros_in_grad: bool = False
    log_max_attention_logit: bool = False
    log_runtime_to_tensorboard: bool = False
    runtime_time_unit: str = "hours"
    barrier_with_L1_time: bool = True
    log_world_size_to_tensorboard: bool = False
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_entity: str | None = None
    logging_level: int | None = None
    filter_warnings: bool = True
    modules_to_filter: list[str] | None = None
    set_level_for_all_loggers: bool = False
    log_energy: bool = False
    save_config_filepath: str | None = None
    moe_routing_trace_path: str | None = None
    moe_routing_trace_max_training_iters: int | None = None
    moe_routing_trace_capture_logits: bool = False
    moe_routing_trace_capture_hidden_states: bool = False
    moe_routing_trace_dump_weights: bool = False


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how checkpoints are saved and loaded (``--save``, ``--load``, ``--ckpt-format``, ...)."""

    save: str | None = None
    save_interval: int | None = None
    save_params_interval: int | None = None
    save_activations_interval: int | None = None
    save_tokens_per_expert_interval: int | None = None
    save_wgrads_interval: int | None = None
    save_dgrads_interval: int | None = None
    save_retain_interval: int | None = None
    most_recent_k: int | None = -1
    save_optim: bool = True
    save_rng: bool = True
    load: str | None = None
    load_optim: bool = True
    load_main_params_from_ckpt: bool = False
    load_rng: bool = True
    non_persistent_save_interval: int | None = None
    non_persistent_ckpt_type: Literal["global", "local", "in_memory"] | None = None
    non_persistent_global_ckpt_dir: str | None = None
    non_persistent_local_ckpt_dir: str | None = None
    non_persistent_local_ckpt_algo: Literal["fully_parallel", "atomic"] = "fully_parallel"
    finetune: bool = False
    pretrained_checkpoint: str | None = None
    ckpt_step: int | None = None
    use_checkpoint_args: bool = False
    use_mp_args_from_checkpoint_args: bool = False
    use_tokenizer_model_from_checkpoint_args: bool = True
    exit_on_missing_checkpoint: bool = False
    ckpt_format: Literal["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"] = "torch_dist"
    auto_detect_ckpt_format: bool = False
    ckpt_convert_format: Literal["torch", "torch_dist"] | None = None
    ckpt_convert_save: str | None = None
    ckpt_convert_update_legacy_dist_opt_format: bool = False
    fully_parallel_save: bool = True
    async_save: bool = False
    async_strategy: Literal["nvrx", "mcore"] = "nvrx"
    use_persistent_ckpt_worker: bool = False
    async_ckpt_cpu_priority: int = 10
    async_ckpt_io_priority: int | None = 3
    async_ckpt_use_cpu_shm: bool = False
    fully_parallel_load: bool = False
    ckpt_fully_parallel_load_exchange_algo: Literal["broadcast", "gather_rounds", "gather_object"] = "broadcast"
    ckpt_fully_parallel_save_process_group: Literal["dp", "ep_dp"] = "dp"
    ckpt_fully_parallel_load_process_group: Literal["dp", "ep_dp"] = "dp"
    ckpt_assume_constant_structure: bool = False
    ckpt_load_validate_sharding_integrity: bool = True
    strict_fsdp_dtensor_load: bool = True
    dist_ckpt_strictness: Literal[
        "assume_ok_unexpected",
        "log_unexpected",
        "log_all",
        "raise_unexpected",
        "raise_all",
        "return_unexpected",
        "return_all",
        "ignore_all",
    ] = "assume_ok_unexpected"
    dist_ckpt_save_pre_mcore_014: bool = False
    dist_ckpt_optim_fully_reshardable: bool = False
    distrib_optim_fully_reshardable_mem_efficient: bool = False
    save_tokenizer_assets: bool = True
    replication: bool = False
    replication_jump: int | None = None
    replication_factor: int = 2
    verify_integrity: bool = False
    stream_ckpt_dequant: bool = True

    def __post_init__(self):
        # Mirrors the argument checks for --async-strategy, --async-save and --verify-integrity.
        if self.async_strategy not in ("nvrx", "mcore"):
            raise ValueError(f"CheckpointConfig.async_strategy is {self.async_strategy!r}; choose 'nvrx' or 'mcore'")
        if not self.async_save:
            # Synchronous saves never go through the resiliency extension.
            self.async_strategy = "mcore"
        if (
            self.async_save
            and self.async_strategy == "nvrx"
            and self.ckpt_format in ("torch_dcp", "fsdp_dtensor")
            and not has_nvrx_checkpointing_async_support()
        ):
            raise ValueError(
                f"CheckpointConfig: async_save with async_strategy='nvrx' and ckpt_format={self.ckpt_format!r} needs "
                "nvidia-resiliency-ext with async checkpointing support; install it or set async_strategy='mcore'"
            )
        if self.verify_integrity and self.ckpt_format != "torch_dist":
            raise ValueError(
                f"CheckpointConfig.verify_integrity needs ckpt_format='torch_dist', got {self.ckpt_format!r}"
            )


@dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer to build and from which files (the ``--tokenizer-*``, ``--vocab-*`` arguments)."""

    vocab_size: int = None
    padded_vocab_size: int = None
    pad_vocab_size: bool = True
    vocab_file: str = None
    merge_file: str = None
    vocab_extra_ids: int = 0
    tokenizer_type: Literal[
        "BertWordPieceLowerCase",
        "BertWordPieceCase",
        "GPT2BPETokenizer",
        "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer",
        "HuggingFaceTokenizer",
        "Llama2Tokenizer",
        "TikTokenizer",
        "MultimodalTokenizer",
        "NullTokenizer",
        "NullMultimodalTokenizer",
        "SFTTokenizer",
    ] = None
    tokenizer_model: str = None
    metadata_path: str | None = None
    special_tokens: list[str] | None = None
    tiktoken_pattern: Literal["v1", "v2"] = None
    tiktoken_num_special_tokens: int = 1000
    tokenizer_sentencepiece_legacy: bool = False
    tokenizer_sentencepiece_ignore_extra_whitespaces: bool = True
    tokenizer_hf_no_use_fast: bool = False
    tokenizer_hf_no_include_special_tokens: bool = False
    trust_remote_code: bool = False
    null_tokenizer_eod_id: int = None
    null_tokenizer_pad_id: int = -1
    chat_template: str | None = None
