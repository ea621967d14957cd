"""Megatron FSDP's flags against the rest of the command line: each conflict is one error naming both flags and
what to use instead, raised by validate_args before anything is built or communicated."""

_SHARDED = ("optim", "optim_grads", "optim_grads_params")


def validate_megatron_fsdp(args) -> None:
    """Refuse flags that cannot combine with ``--use-megatron-fsdp`` (and FSDP-only flags without it)."""
    if not getattr(args, "use_megatron_fsdp", False):
        if getattr(args, "fsdp_double_buffer", False):
            raise ValueError("--fsdp-double-buffer needs --use-megatron-fsdp (it double-buffers FSDP's gathers)")
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
    if args.ckpt_format != "torch_dist":
        raise ValueError(
            f"--use-megatron-fsdp with --ckpt-format {args.ckpt_format}: Megatron FSDP checkpoints are written as "
            "torch_dist here (fsdp_dtensor is not supported yet); use --ckpt-format torch_dist"
        )
    if args.fsdp_double_buffer and strategy != "optim_grads_params":
        raise ValueError(
            f"--fsdp-double-buffer with --data-parallel-sharding-strategy {strategy}: only optim_grads_params "
            "gathers parameters; use --data-parallel-sharding-strategy optim_grads_params or drop --fsdp-double-buffer"
        )
