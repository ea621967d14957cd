"""The MoE part of the training log: Megatron-LM's auxiliary-loss terms in the log line and in TensorBoard / W&B.

Routers record their load-balancing and z-losses per layer in the MoE aux-loss tracker during forward;
``track_moe_metrics`` (megatron.core.transformer.moe.moe_utils) reduces them across ranks, adds the average over
MoE layers of each to the training loss dict (so the log line shows ``load_balancing_loss: ... |`` next to
``lm loss``), writes them to TensorBoard (per layer as ``moe/<name>_layer_<i>`` with ``--moe-per-layer-logging``) and
clears the tracker for the next step. It runs every iteration on every rank, since the reduction is a collective.
"""

from megatron.core.num_microbatches_calculator import get_num_microbatches


def moe_track_names(args):
    """The tracked loss names Megatron-LM logs for these arguments, by its rule: ``"<type>" in
    --moe-router-load-balancing-type`` (membership for a list, a substring test for one string, so that
    ``seq_aux_loss`` alone also tracks ``load_balancing_loss``, which then stays zero and is left out of the log
    line), and the z-loss when ``--moe-z-loss-coeff`` is set."""
    balancing = args.moe_router_load_balancing_type
    names = [
        name
        for balancing_type, name in (
            ("aux_loss", "load_balancing_loss"),
            ("seq_aux_loss", "seq_load_balancing_loss"),
            ("global_aux_loss", "global_load_balancing_loss"),
        )
        if balancing_type in balancing
    ]
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def track_moe_losses(args, iteration: int, writer, wandb_writer, total_loss_dict) -> None:
    """Reduce, log and clear this step's MoE losses (every rank calls this every iteration). The averages go into
    ``total_loss_dict``, so the log line prints them after ``lm loss`` averaged over the log interval, as
    Megatron-LM's does (``track_moe_metrics``' own text fragment, this step's values only, is not used)."""
    if args.num_experts is None:
        return
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    moe_layer_freq = args.moe_layer_freq
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern:
        # A hybrid's MoE layers are its 'E' layers: average over those, as Megatron-LM does for hybrid models.
        from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

        main = pattern.split(Symbols.MTP_SEPARATOR)[0].replace(Symbols.PIPE, "")
        moe_layer_freq = [int(symbol == Symbols.MOE) for symbol in main]

    track_moe_metrics(
        loss_scale=1.0 / get_num_microbatches(),
        iteration=iteration,
        writer=writer,
        wandb_writer=wandb_writer,
        total_loss_dict=total_loss_dict,
        per_layer_logging=args.moe_per_layer_logging,
        force_initialize=True,
        track_names=moe_track_names(args),
        num_layers=args.num_layers,
        moe_layer_freq=moe_layer_freq,
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
    )
