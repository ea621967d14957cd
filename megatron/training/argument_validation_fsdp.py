"""The fully sharded data parallel part of ``validate_args``: what ``--use-megatron-fsdp`` and ``--use-torch-fsdp2``
cannot be combined with, refused before anything is built or communicated, each error naming both flags and what to
use instead.

Torch FSDP2 keeps Megatron-LM's rules: no pipeline or expert parallelism, not with the distributed optimizer (FSDP2
shards the optimizer state itself) or Megatron FSDP, untied embedding and output weights, no fp16, and a
``torch_dist`` checkpoint (Megatron-LM also allows ``torch_dcp``, not supported yet here with FSDP2). Ours: no
optimizer CPU offload or Muon, which need whole parameters.

Megatron FSDP saves ``fsdp_dtensor`` (Megatron-LM's only format for it) or ``torch_dist`` (ours, loadable without
FSDP); ``fsdp_dtensor`` needs Megatron FSDP, as in Megatron-LM.
"""

_SHARDED = ("optim", "optim_grads", "optim_grads_params")


def validate_megatron_fsdp(args) -> None:
    """Refuse flags that cannot combine with ``--use-megatron-fsdp`` (and FSDP-only flags without it)."""
    if not getattr(args, "use_megatron_fsdp", False):
        if getattr(args, "fsdp_double_buffer", False):
            raise ValueError("--fsdp-double-buffer needs --use-megatron-fsdp (it double-buffers FSDP's gathers)")
        if args.ckpt_format == "fsdp_dtensor":
            raise ValueError(
                "--ckpt-format fsdp_dtensor holds Megatron FSDP's shards and needs --use-megatron-fsdp (as in "
                "Megatron-LM); without it use --ckpt-format torch_dist"
            )
        return
    strategy = args.data_parallel_sharding_strategy
    if getattr(args, "use_torch_fsdp2", False):
        raise ValueError(
            "--use-megatron-fsdp and --use-torch-fsdp2 both shard the model over data-parallel ranks; use one of them"
        )
    if strategy in _SHARDED and not args.use_distributed_optimizer:
        raise ValueError(
            f"--use-megatron-fsdp with --data-parallel-sharding-strategy {strategy} (the default) steps the "
            "optimizer shard by shard: add --use-distributed-optimizer, or use --data-parallel-sharding-strategy "
            "no_shard"
        )
    if strategy == "no_shard" and args.use_distributed_optimizer:
        raise ValueError(
            "--use-megatron-fsdp with --data-parallel-sharding-strategy no_shard and --use-distributed-optimizer: "
            "no_shard keeps the optimizer state whole; use --data-parallel-sharding-strategy optim to shard it"
        )
    _validate_fsdp_checkpoint_format(args, strategy)
    if args.fsdp_double_buffer and strategy != "optim_grads_params":
        raise ValueError(
            f"--fsdp-double-buffer with --data-parallel-sharding-strategy {strategy}: only optim_grads_params "
            "gathers parameters; use --data-parallel-sharding-strategy optim_grads_params or drop --fsdp-double-buffer"
        )


def _validate_fsdp_checkpoint_format(args, strategy: str) -> None:
    if args.ckpt_format not in ("torch_dist", "fsdp_dtensor"):
        raise ValueError(
            f"--use-megatron-fsdp with --ckpt-format {args.ckpt_format}: Megatron FSDP checkpoints are written as "
            "fsdp_dtensor (Megatron-LM's format) or torch_dist; use --ckpt-format fsdp_dtensor or torch_dist"
        )
    if args.ckpt_format != "fsdp_dtensor":
        return
    if strategy == "no_shard":
        raise ValueError(
            "--ckpt-format fsdp_dtensor with --data-parallel-sharding-strategy no_shard: the format stores the "
            "distributed optimizer's shards (Megatron-LM always shards with Megatron FSDP); use "
            "--data-parallel-sharding-strategy optim (or optim_grads / optim_grads_params), or --ckpt-format torch_dist"
        )
    if args.optimizer not in ("adam", "sgd"):
        raise ValueError(
            f"--optimizer {args.optimizer} with --ckpt-format fsdp_dtensor: the format stores the distributed "
            "optimizer's Adam or SGD state (Megatron FSDP runs only those in Megatron-LM); use --optimizer adam or "
            "sgd, or --ckpt-format torch_dist"
        )
    if args.async_save:
        raise ValueError(
            "--async-save with --ckpt-format fsdp_dtensor: not supported yet (Megatron-LM needs NVIDIA's "
            "resiliency extension for it); drop --async-save, or use --ckpt-format torch_dist"
        )
    if args.ckpt_convert_format is not None:
        raise ValueError(
            f"--ckpt-convert-format {args.ckpt_convert_format} with --ckpt-format fsdp_dtensor: not supported yet; "
            "load the checkpoint with --ckpt-format fsdp_dtensor and save it with --ckpt-format torch_dist instead"
        )


def validate_torch_fsdp2_args(args) -> None:
    """Refuse flags that ``--use-torch-fsdp2`` cannot be combined with (see the module docstring)."""
    if not args.use_torch_fsdp2:
        return
    conflicts = [
        (
            args.pipeline_model_parallel_size > 1,
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}",
            "use --pipeline-model-parallel-size 1, or drop --use-torch-fsdp2 for DDP with pipeline parallelism",
        ),
        (
            args.expert_model_parallel_size > 1,
            f"--expert-model-parallel-size {args.expert_model_parallel_size}",
            "use --expert-model-parallel-size 1, or drop --use-torch-fsdp2",
        ),
        (
            args.use_distributed_optimizer,
            "--use-distributed-optimizer",
            "FSDP2 already shards the optimizer state over the data-parallel ranks; drop --use-distributed-optimizer",
        ),
        (
            args.use_megatron_fsdp,
            "--use-megatron-fsdp",
            "choose one fully sharded implementation",
        ),
        (
            not args.untie_embeddings_and_output_weights,
            "tied embedding and output weights (no --untie-embeddings-and-output-weights)",
            "FSDP2 cannot shard one parameter used by two units; add --untie-embeddings-and-output-weights",
        ),
        (args.fp16, "--fp16", "use --bf16 or fp32"),
        (
            args.ckpt_format != "torch_dist",
            f"--ckpt-format {args.ckpt_format}",
            "use --ckpt-format torch_dist (its checkpoints also load without FSDP2)",
        ),
        (
            args.optimizer_cpu_offload,
            "--optimizer-cpu-offload",
            "the offloaded optimizer steps whole parameters, not DTensor shards; use --use-megatron-fsdp with "
            "--use-distributed-optimizer for offload with sharding",
        ),
        (
            args.optimizer in ("muon", "dist_muon"),
            f"--optimizer {args.optimizer}",
            "Newton-Schulz needs each matrix whole and FSDP2 shards it over data-parallel ranks; use "
            "--optimizer dist_muon without --use-torch-fsdp2",
        ),
    ]
    for conflicting, flag, fix in conflicts:
        if conflicting:
            raise ValueError(f"--use-torch-fsdp2 cannot be combined with {flag}: {fix}")
