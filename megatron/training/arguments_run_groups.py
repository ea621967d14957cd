"""Megatron-LM's hand-written argument groups that describe the run: training, learning rate, checkpointing,
distributed, validation, data, logging and deprecated flags. A flag that is the mechanical image of a config
dataclass field is generated from it (``add_field_argument``). ``arguments`` adds the groups in Megatron-LM's order.
"""

import os
import signal

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer_param_scheduler import LR_DECAY_STYLES
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.argument_utils import add_field_argument, enum_by_name
from megatron.training.arguments_support import argument_group
from megatron.training.flag_tables import (
    CKPT_FORMATS,
    DEPRECATED_FLAGS,
    OPTIMIZERS,
)


def add_training_args(parser):
    group = parser.add_argument_group(title="training")
    group.add_argument(
        "--micro-batch-size", type=int, default=None, help="Samples per micro-batch on each model replica."
    )
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step over all data-parallel ranks; a multiple of "
        "--micro-batch-size times the data-parallel size (default: exactly that product).",
    )
    group.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        help="Ramp the global batch size up: <start batch size> <increment> <ramp-up samples>, "
        "e.g. '16 8 300000' with --global-batch-size 1024.",
    )
    group.add_argument(
        "--step-batch-size-schedule",
        type=str,
        default=None,
        help="Global batch size by stages instead of --rampup-batch-size: 'threshold:size' pairs, "
        "each threshold counted in consumed tokens (K/M/B suffixes allowed), the first 0 (e.g. "
        "'0:768 250B:1536').",
    )
    group.add_argument(
        "--decrease-batch-size-if-needed",
        action="store_true",
        help="Round the global batch size down to a multiple of micro-batch size x data-parallel "
        "size instead of failing.",
    )
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Recompute activations in the backward pass (same as --recompute-granularity selective).",
    )
    add_field_argument(group, TransformerConfig, "recompute_granularity", choices=["full", "selective"])
    add_field_argument(group, TransformerConfig, "recompute_method", choices=["uniform", "block"])
    add_field_argument(group, TransformerConfig, "recompute_num_layers")
    add_field_argument(group, TransformerConfig, "recompute_modules", nargs="+")
    add_field_argument(group, TransformerConfig, "distribute_saved_activations", default=False)
    group.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="Do not check the loss and the gradients for NaN/Inf at each step.",
    )
    group.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="Iterations to train for, over all runs (or give --train-samples).",
    )
    group.add_argument(
        "--train-samples", type=int, default=None, help="Samples to train on, over all runs (or give --train-iters)."
    )
    group.add_argument("--log-interval", type=int, default=100, help="Iterations between two training log lines.")
    group.add_argument(
        "--exit-interval", type=int, default=None, help="Exit once the iteration number is a multiple of this."
    )
    group.add_argument(
        "--exit-duration-in-mins",
        type=int,
        default=None,
        help="Exit (after saving, with --save) once training has run this many minutes.",
    )
    group.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On the --exit-signal (SIGTERM), save a checkpoint and exit cleanly.",
    )
    group.add_argument(
        "--exit-signal",
        type=enum_by_name(signal.Signals),
        default=signal.SIGTERM,
        choices=list(signal.Signals),
        help="The signal --exit-signal-handler catches, by name.",
    )
    group.add_argument("--tensorboard-dir", type=str, default=None, help="Write TensorBoard logs to this directory.")
    _add_training_runtime_args(group)
    return parser


def _add_training_runtime_args(group):
    """The rest of Megatron-LM's "training" group, in its order: kernel fusions, optimizer, data loader, memory."""
    add_field_argument(group, TransformerConfig, "masked_softmax_fusion", default=True)
    group.add_argument(
        "--no-bias-gelu-fusion",
        action="store_false",
        dest="bias_gelu_fusion",
        help="Do not fuse the MLP bias add and GELU.",
    )
    group.add_argument(
        "--no-bias-swiglu-fusion",
        action="store_false",
        dest="bias_swiglu_fusion",
        help="Do not fuse the MLP bias add and SwiGLU.",
    )
    add_field_argument(group, TransformerConfig, "bias_dropout_fusion", default=True)
    add_field_argument(group, TransformerConfig, "apply_rope_fusion", flags=["--no-rope-fusion"], default=True)
    add_field_argument(group, ModelParallelConfig, "cross_entropy_loss_fusion")
    group.add_argument(
        "--no-persist-layer-norm", action="store_true", help="Do not use apex's persistent layer-norm kernel."
    )
    add_field_argument(group, TransformerConfig, "add_bias_linear", flags=["--disable-bias-linear"])
    add_field_argument(group, TransformerConfig, "add_qkv_bias")
    add_field_argument(
        group,
        OptimizerConfig,
        "optimizer",
        choices=OPTIMIZERS,
        help_suffix=" (adam and sgd here; the others are not supported yet).",
    )
    group.add_argument(
        "--dataloader-type",
        type=str,
        default=None,
        choices=["single", "cyclic", "external"],
        help="single: one pass in order; cyclic: reshuffled every epoch; external: the dataset "
        "provider returns iterators (default: single).",
    )
    add_field_argument(group, ModelParallelConfig, "sequence_parallel")
    add_field_argument(
        group,
        ModelParallelConfig,
        "gradient_accumulation_fusion",
        flags=["--no-gradient-accumulation-fusion"],
        default=True,
    )
    group.add_argument(
        "--use-mcore-models",
        action="store_true",
        dest="deprecated_use_mcore_models",
        help="Deprecated and ignored: Megatron-Core models are the only models.",
    )
    group.add_argument(
        "--manual-gc",
        action="store_true",
        help="Disable Python's automatic garbage collection; collect at --manual-gc-interval and "
        "around evaluation instead, at the same time on every rank.",
    )
    group.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="Iterations between manual garbage collections (0: only around evaluation).",
    )
    group.add_argument(
        "--no-manual-gc-eval",
        "--disable-manual-gc-eval",
        action="store_false",
        dest="manual_gc_eval",
        help="With --manual-gc, do not collect around evaluation.",
    )
    add_field_argument(group, ModelParallelConfig, "use_cpu_initialization", default=None)
    group.add_argument(
        "--empty-unused-memory-level",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="Release cached accelerator memory each iteration: 0 off, 1 moderate, 2 aggressive.",
    )
    add_field_argument(group, ModelParallelConfig, "deterministic_mode")
    add_field_argument(group, TransformerConfig, "calculate_per_token_loss")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Print which global ranks form each TP/PP/DP/CP/EP group, the layers and parameters of "
        "each pipeline stage and the theoretical memory, then exit without training.",
    )


def add_learning_rate_args(parser):
    group = parser.add_argument_group(title="learning rate")
    add_field_argument(group, OptimizerConfig, "lr")
    group.add_argument(
        "--lr-decay-style",
        type=str,
        default="linear",
        choices=LR_DECAY_STYLES,
        help="Learning-rate decay after warm-up.",
    )
    group.add_argument(
        "--lr-wsd-decay-style",
        type=str,
        default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="Decay of the annealing phase of the WSD schedule.",
    )
    group.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Iterations to decay the learning rate over (default: --train-iters).",
    )
    group.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="Samples to decay the learning rate over (default: --train-samples).",
    )
    group.add_argument(
        "--lr-wsd-decay-samples", type=int, default=None, help="Samples in the annealing phase of the WSD schedule."
    )
    group.add_argument(
        "--lr-wsd-decay-iters", type=int, default=None, help="Iterations in the annealing phase of the WSD schedule."
    )
    group.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Fraction of the decay iterations/samples spent warming up (instead of "
        "--lr-warmup-iters/--lr-warmup-samples).",
    )
    group.add_argument("--lr-warmup-iters", type=int, default=0, help="Iterations of linear learning-rate warm-up.")
    group.add_argument("--lr-warmup-samples", type=int, default=0, help="Samples of linear learning-rate warm-up.")
    group.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate warm-up starts from.")
    add_field_argument(group, OptimizerConfig, "min_lr", default=0.0)
    group.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="Take the schedule (lr, warm-up, min lr, decay length and style) from these flags, "
        "ignoring the checkpoint's.",
    )
    group.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="Take the schedule from the checkpoint, ignoring these flags.",
    )
    add_field_argument(group, OptimizerConfig, "decoupled_lr")
    add_field_argument(group, OptimizerConfig, "decoupled_min_lr")
    return parser


def add_checkpointing_args(parser):
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    group.add_argument(
        "--save-interval",
        "--persistent-save-interval",
        type=int,
        default=None,
        help="Iterations between two checkpoint saves.",
    )
    group.add_argument("--no-save-optim", action="store_true", default=None, help="Do not save the optimizer state.")
    group.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save the RNG state.")
    group.add_argument("--load", type=str, default=None, help="Directory to load a checkpoint from.")
    group.add_argument(
        "--no-load-optim",
        action="store_true",
        default=None,
        help="Do not load the optimizer state from the checkpoint.",
    )
    group.add_argument(
        "--no-load-rng", action="store_true", default=None, help="Do not load the RNG state from the checkpoint."
    )
    group.add_argument(
        "--finetune",
        action="store_true",
        help="Load only the model weights and start at iteration 0 (no optimizer or RNG state).",
    )
    group.add_argument(
        "--pretrained-checkpoint",
        type=str,
        default=None,
        help="Directory of a pretrained checkpoint to finetune from (when --load has none).",
    )
    group.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="Take the model arguments from the checkpoint given by --load.",
    )
    group.add_argument(
        "--use-mp-args-from-checkpoint-args",
        action="store_true",
        help="With --use-checkpoint-args, take the model-parallel layout (TP, PP, virtual stages) "
        "from the checkpoint too; without it this command line's layout is used and the checkpoint "
        "is resharded on load.",
    )
    group.add_argument(
        "--no-use-tokenizer-model-from-checkpoint-args",
        "--disable-use-tokenizer-model-from-checkpoint-args",
        action="store_false",
        dest="use_tokenizer_model_from_checkpoint_args",
        help="With --use-checkpoint-args, keep this command line's --tokenizer-model. (This project's "
        "--use-checkpoint-args never takes the tokenizer model path from the checkpoint.)",
    )
    group.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="With --load, exit when no checkpoint is found instead of starting from scratch.",
    )
    group.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="Load the checkpoint of this iteration instead of the one the tracker file names.",
    )
    group.add_argument(
        "--no-ckpt-verify",
        action="store_false",
        dest="ckpt_verify",
        help="Load checkpoint files without checking them against the checksums recorded when they were saved "
        "(checked by default; a damaged file then loads silently). This project's flag, not Megatron-LM's.",
    )
    _add_checkpoint_format_args(group)
    return parser


def _add_checkpoint_format_args(group):
    """How checkpoints are written: format, conversion, optimizer layout, parallel and asynchronous saves."""
    group.add_argument(
        "--ckpt-format",
        type=str,
        default="torch_dist",
        choices=CKPT_FORMATS,
        help="Checkpoint format to save: torch_dist (distributed, loads into any layout), torch (legacy, one "
        "model_optim_rng.pt per model-parallel rank) or torch_dcp (PyTorch DCP of the plain state dict; no tensor, "
        "pipeline or expert parallelism, no distributed optimizer). fsdp_dtensor is not supported.",
    )
    group.add_argument(
        "--auto-detect-ckpt-format",
        action="store_true",
        help="Load a checkpoint in whichever format it is (with --ckpt-format torch_dist, the default, the format "
        "is always detected).",
    )
    group.add_argument(
        "--ckpt-convert-format",
        type=str,
        default=None,
        choices=["torch", "torch_dist"],
        help="Convert the --load checkpoint to this format, save it to <--ckpt-convert-save>/<format> and exit.",
    )
    group.add_argument(
        "--ckpt-convert-save",
        type=str,
        default=None,
        help="Where --ckpt-convert-format saves the converted checkpoint.",
    )
    group.add_argument(
        "--dist-ckpt-optim-fully-reshardable",
        action="store_true",
        help="Save the distributed optimizer's state in the fully_reshardable layout (shaped like the parameters, "
        "reloads at any TP/PP/DP layout) instead of the default dp_reshardable one (reloads at another DP size only).",
    )
    group.add_argument(
        "--distrib-optim-fully-reshardable-mem-efficient",
        action="store_true",
        help="Recorded in the checkpoint's metadata as Megatron-Core does; the saved content is the same either way "
        "(in Megatron-Core it lowers the peak memory of the fully_reshardable gather at some speed).",
    )
    group.add_argument(
        "--async-save", action="store_true", help="Write checkpoints in the background (torch_dist only)."
    )
    group.add_argument(
        "--ckpt-fully-parallel-save",
        action="store_true",
        dest="ckpt_fully_parallel_save_deprecated",
        help="Deprecated and ignored: fully parallel save is the default (see --no-ckpt-fully-parallel-save).",
    )
    group.add_argument(
        "--no-ckpt-fully-parallel-save",
        action="store_false",
        dest="ckpt_fully_parallel_save",
        help="Do not spread the checkpoint writes over the data-parallel ranks.",
    )
    group.add_argument(
        "--ckpt-fully-parallel-load",
        action="store_true",
        help="Spread the checkpoint reads over the data-parallel ranks.",
    )


def add_distributed_args(parser):
    group = parser.add_argument_group(title="distributed")
    add_field_argument(group, ModelParallelConfig, "tensor_model_parallel_size")
    add_field_argument(group, ModelParallelConfig, "pipeline_model_parallel_size")
    add_field_argument(
        group,
        TransformerConfig,
        "num_layers_in_first_pipeline_stage",
        flags=["--decoder-first-pipeline-num-layers"],
        dest="decoder_first_pipeline_num_layers",
    )
    add_field_argument(
        group,
        TransformerConfig,
        "num_layers_in_last_pipeline_stage",
        flags=["--decoder-last-pipeline-num-layers"],
        dest="decoder_last_pipeline_num_layers",
    )
    group.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per model chunk of the interleaved schedule (sets the virtual pipeline size).",
    )
    group.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="Model chunks per pipeline rank for the interleaved schedule.",
    )
    group.add_argument(
        "--pipeline-model-parallel-layout",
        type=str,
        default=None,
        help="The layers of every pipeline stage, e.g. 'Et*3|(tt|)*29,m|L': E embedding, t transformer layer, "
        "m MTP layer, L loss; '|' separates stages, 'x*n' and '(...)*n' repeat, commas are ignored. Stages are "
        "listed in pipeline order; more stages than --pipeline-model-parallel-size ranks give virtual stages.",
    )
    add_field_argument(
        group,
        ModelParallelConfig,
        "microbatch_group_size_per_vp_stage",
        flags=["--microbatch-group-size-per-virtual-pipeline-stage"],
    )
    add_field_argument(
        group, ModelParallelConfig, "overlap_p2p_comm", flags=["--no-overlap-p2p-communication"], default=True
    )
    add_field_argument(
        group, ModelParallelConfig, "overlap_p2p_comm_warmup_flush", flags=["--overlap-p2p-communication-warmup-flush"]
    )
    group.add_argument(
        "--distributed-backend",
        type=str,
        default="nccl",
        choices=["nccl", "gloo"],
        help="torch.distributed backend; nccl needs GPUs and falls back to gloo (with a warning) "
        "on a machine without CUDA.",
    )
    group.add_argument(
        "--distributed-timeout-minutes",
        type=int,
        default=10,
        help="Timeout of torch.distributed collectives, in minutes.",
    )
    add_field_argument(group, DistributedDataParallelConfig, "overlap_grad_reduce")
    group.add_argument(
        "--no-align-grad-reduce",
        "--disable-align-grad-reduce",
        action="store_false",
        dest="align_grad_reduce",
        help="With --overlap-grad-reduce and pipeline parallelism, let each stage launch its gradient "
        "reductions on its own instead of all stages together.",
    )
    add_field_argument(
        group, DistributedDataParallelConfig, "bucket_size", flags=["--ddp-bucket-size"], dest="ddp_bucket_size"
    )
    add_field_argument(
        group,
        DistributedDataParallelConfig,
        "pad_buckets_for_high_nccl_busbw",
        flags=["--ddp-pad-buckets-for-high-nccl-busbw"],
        dest="ddp_pad_buckets_for_high_nccl_busbw",
    )
    add_field_argument(
        group,
        DistributedDataParallelConfig,
        "average_in_collective",
        flags=["--ddp-average-in-collective"],
        dest="ddp_average_in_collective",
    )
    add_field_argument(group, DistributedDataParallelConfig, "overlap_param_gather")
    add_field_argument(
        group, DistributedDataParallelConfig, "align_param_gather", flags=["--no-align-param-gather"], default=True
    )
    group.add_argument(
        "--local-rank",
        type=int,
        default=int(os.getenv("LOCAL_RANK", "0")),
        help="Local rank from the launcher (default: $LOCAL_RANK).",
    )
    add_field_argument(group, TransformerConfig, "account_for_embedding_in_pipeline_split")
    add_field_argument(group, TransformerConfig, "account_for_loss_in_pipeline_split")
    add_field_argument(group, DistributedDataParallelConfig, "use_distributed_optimizer")
    add_field_argument(group, DistributedDataParallelConfig, "num_distributed_optimizer_instances")
    add_field_argument(
        group,
        DistributedDataParallelConfig,
        "data_parallel_sharding_strategy",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
        default="optim_grads_params",
        help_suffix=" Read only with --use-megatron-fsdp.",
    )
    add_field_argument(group, DistributedDataParallelConfig, "gradient_reduce_div_fusion")
    add_field_argument(group, ModelParallelConfig, "context_parallel_size")
    return parser


def add_validation_args(parser):
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-iters", type=int, default=100, help="Iterations of each validation/test run.")
    group.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="Iterations between two validation runs (default: no validation during training).",
    )
    group.add_argument(
        "--skip-train", action="store_true", help="Skip the training loop: only evaluate (if asked) and exit."
    )
    return parser


def add_data_args(parser):
    group = parser.add_argument_group(title="data and dataloader")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Dataset prefixes (path without .bin/.idx) cut into train/valid/test by --split: one "
        "prefix, several prefixes (weighted by size) or 'weight prefix' pairs.",
    )
    add_field_argument(
        group,
        BlendedMegatronDatasetConfig,
        "split",
        help_suffix=" With --data-path and no --split, '969, 30, 1' is used (Megatron-LM's legacy default).",
    )
    for split in ("train", "valid", "test"):
        group.add_argument(
            f"--{split}-data-path",
            nargs="*",
            default=None,
            help=f"Dataset prefixes (as --data-path) read only for the {split} split.",
        )
    group.add_argument(
        "--data-args-path",
        type=str,
        default=None,
        help="File holding the --data-path list (for lists too long for the command line).",
    )
    group.add_argument(
        "--per-split-data-args-path",
        type=str,
        default=None,
        help="JSON file with 'train', 'valid' and 'test' keys holding per-split data-path lists.",
    )
    add_field_argument(
        group,
        BlendedMegatronDatasetConfig,
        "path_to_cache",
        flags=["--data-cache-path"],
        dest="data_cache_path",
        type=None,
    )
    add_field_argument(group, BlendedMegatronDatasetConfig, "mmap_bin_files")
    add_field_argument(group, BlendedMegatronDatasetConfig, "mock", flags=["--mock-data"], dest="mock_data")
    group.add_argument("--seq-length", type=int, default=None, help="Tokens per training sequence.")
    group.add_argument(
        "--encoder-seq-length", type=int, default=None, help="Another name for --seq-length (give one of them)."
    )
    group.add_argument("--num-workers", type=int, default=2, help="Data-loader worker processes.")
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        add_field_argument(group, GPTDatasetConfig, name, default=False)  # the config's None means "not given"
    add_field_argument(
        group,
        GPTDatasetConfig,
        "create_attention_mask",
        flags=["--no-create-attention-mask-in-dataloader"],
        dest="create_attention_mask_in_dataloader",
    )
    add_field_argument(group, BlendedMegatronDatasetConfig, "num_dataset_builder_threads")
    add_field_argument(group, BlendedMegatronDatasetConfig, "mid_level_dataset_surplus")
    return parser


def add_logging_args(parser):
    group = parser.add_argument_group(title="logging")
    group.add_argument("--log-params-norm", action="store_true", help="Compute and log the parameters' norm.")
    add_field_argument(group, OptimizerConfig, "log_num_zeros_in_grad")
    group.add_argument("--log-throughput", action="store_true", help="Log throughput (TFLOP/s per device).")
    group.add_argument(
        "--log-progress",
        action="store_true",
        help="Append the job's progress (start, checkpoints with throughput) to <--save>/progress.txt.",
    )
    group.add_argument(
        "--timing-log-level",
        type=int,
        default=0,
        choices=range(0, 3),
        help="Timers to report: 0 only the iteration time (no extra synchronisation), 1 also "
        "once-per-iteration operations, 2 also frequent operations.",
    )
    group.add_argument(
        "--no-barrier-with-level-1-timing",
        action="store_false",
        dest="barrier_with_L1_time",
        help="Do not put a barrier around level-1 timings.",
    )
    group.add_argument(
        "--timing-log-option",
        type=str,
        default="minmax",
        choices=["max", "minmax", "all"],
        help="Timer values to report across ranks: the max, min and max, or every rank's.",
    )
    group.add_argument(
        "--tensorboard-log-interval", type=int, default=1, help="Iterations between two TensorBoard writes."
    )
    group.add_argument(
        "--tensorboard-queue-size", type=int, default=1000, help="TensorBoard events queued before a flush to disk."
    )
    group.add_argument("--log-timers-to-tensorboard", action="store_true", help="Write the timers to TensorBoard.")
    group.add_argument(
        "--no-log-loss-scale-to-tensorboard",
        "--disable-log-loss-scale-to-tensorboard",
        action="store_false",
        dest="log_loss_scale_to_tensorboard",
        help="Do not write the loss scale to TensorBoard.",
    )
    group.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Write the validation perplexity to TensorBoard.",
    )
    group.add_argument("--log-memory-to-tensorboard", action="store_true", help="Write memory usage to TensorBoard.")
    group.add_argument(
        "--log-world-size-to-tensorboard", action="store_true", help="Write the world size to TensorBoard."
    )
    group.add_argument(
        "--wandb-project",
        type=str,
        default=None,
        help="Weights & Biases project (empty: no W&B). Set WANDB_MODE=offline to log offline.",
    )
    group.add_argument("--wandb-entity", type=str, default=None, help="Weights & Biases entity (team or user).")
    group.add_argument("--wandb-exp-name", type=str, default=None, help="Weights & Biases run name.")
    group.add_argument(
        "--wandb-save-dir",
        type=str,
        default=None,
        help="Local directory for Weights & Biases files (default: <--save>/wandb).",
    )
    group.add_argument("--logging-level", type=int, default=None, help="Python logging level (e.g. 20 for INFO).")
    group.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="Peak dense TFLOP/s of one device, for the MFU figure (default: looked up for known "
        "devices; MFU is not reported for an unknown one).",
    )
    return parser


def add_deprecated_args(parser):
    """Megatron-LM's renamed flags: accepted so that validate_args can name their replacement."""
    group = argument_group(parser, "deprecated")
    for flag, replacement in DEPRECATED_FLAGS.items():
        if flag == "--checkpoint-activations":
            group.add_argument(flag, action="store_true", help=f"No longer valid: use {replacement}.")
        else:
            group.add_argument(flag, type=int, default=None, help=f"No longer valid: use {replacement}.")
    return parser
