"""Mixture-of-experts part of ``validate_args``: Megatron-LM's derived MoE settings and the checks that need the
launch layout, all before any process group exists.

Megatron-LM's rules kept here: ``--moe-ffn-hidden-size`` defaults to ``--ffn-hidden-size``; a one-element
``--moe-router-load-balancing-type`` / ``--moe-aux-loss-coeff`` list becomes a scalar; expert parallelism needs
``--num-experts`` divisible by ``--expert-model-parallel-size`` and no fp16; the world size must split into
expert-TP x EP x PP. Everything else about MoE settings (top-k vs experts, TP without SP, capacity without token
dropping, the --moe-layer-freq pattern length, ...) is TransformerConfig's validation, which ``validate_args`` runs
on the config the arguments describe (``_check_configs``), so a bad combination fails at start-up with the config's
message, in flag terms.
"""

from megatron.core.rank_generator import check_layout
from megatron.training.flag_tables import flag_for


def validate_moe_args(args) -> None:
    """Check and complete the MoE arguments of ``args`` in place (see the module docstring)."""
    ep, etp, pp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.pipeline_model_parallel_size
    if args.num_experts is None:
        if ep > 1:
            raise ValueError(
                f"--expert-model-parallel-size {ep} needs an MoE model: set --num-experts (a multiple of {ep})"
            )
        return
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, name, value[0])
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.num_experts % ep != 0:
        raise ValueError(
            f"--num-experts ({args.num_experts}) is not divisible by --expert-model-parallel-size ({ep}); every EP "
            "rank holds the same number of experts: change one of them"
        )
    if ep > 1 and args.fp16:
        raise ValueError("expert parallelism (--expert-model-parallel-size > 1) does not support --fp16; use --bf16")
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    check_layout(args.world_size, tp, pp, cp, ep, etp, name=flag_for)
