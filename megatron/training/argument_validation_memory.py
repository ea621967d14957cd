"""Memory-saving part of ``validate_args``: the precision-aware optimizer, optimizer CPU offload and activation
offloading flags, checked before any process group exists.

Most rules belong to the configs and run when ``validate_args`` builds them (``OptimizerConfig``: the precision-aware
optimizer needs ``--use-distributed-optimizer`` and Adam, ``--optimizer-offload-fraction`` lies in [0, 1];
``TransformerConfig``: ``--cpu-offloading-num-layers`` below ``--num-layers``, ``--offload-modules`` names), and
their messages come back in flag terms. What only the command line can say is checked here: fp8 Adam moments need an
fp8 scaling recipe, which Megatron-LM takes from ``--fp8-format`` (its ``--fp8-recipe`` has a default, so the
format is what turns fp8 on).
"""

_FP8_MOMENT_FLAGS = (("exp_avg_dtype", "--exp-avg-dtype"), ("exp_avg_sq_dtype", "--exp-avg-sq-dtype"))


def validate_memory_args(args) -> None:
    """Check the memory-saving flags of ``args`` (see the module docstring)."""
    for name, flag in _FP8_MOMENT_FLAGS:
        if getattr(args, name) == "fp8" and getattr(args, "fp8", None) is None:
            raise ValueError(
                f"{flag} fp8 needs an fp8 scaling recipe: give --fp8-format (with --fp8-recipe), or store the "
                f"moments in 16 bits ({flag} bf16)"
            )
    if args.optimizer_cpu_offload and not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        raise ValueError(
            f"--optimizer-offload-fraction {args.optimizer_offload_fraction} is outside [0, 1]; give the fraction "
            "of the parameters whose optimizer state lives on the host (1.0: all of it)"
        )
