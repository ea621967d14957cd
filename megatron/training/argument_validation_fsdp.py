"""Torch FSDP2 part of ``validate_args``: what ``--use-torch-fsdp2`` cannot be combined with, refused before any
process group exists, each error naming both flags and what to use instead.

Megatron-LM's rules kept here: no pipeline or expert parallelism, not with the distributed optimizer (FSDP2 shards
the optimizer state itself) or Megatron FSDP, untied embedding and output weights, no fp16, and a ``torch_dist``
checkpoint (Megatron-LM also allows ``torch_dcp``, not supported yet here with FSDP2). Context parallelism is not
supported yet here either.
"""


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
    ]
    for conflicting, flag, fix in conflicts:
        if conflicting:
            raise ValueError(f"--use-torch-fsdp2 cannot be combined with {flag}: {fix}")
