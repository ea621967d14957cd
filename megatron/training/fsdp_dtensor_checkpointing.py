"""Megatron-LM's ``fsdp_dtensor`` checkpoint format (``--ckpt-format fsdp_dtensor``, for ``--use-megatron-fsdp``).

``<save>/iter_0000100/`` holds ``.metadata`` and ``__<rank>_0.distcp`` files of one PyTorch DCP state dict, with
Megatron-LM's keys:

- ``model.module.<name>`` (``model0.``, ``model1.``... per virtual pipeline stage): the main weights (the fp32 copy
  of a bf16 model), each a global tensor written in the pieces the data-parallel ranks step;
- ``optimizer.state.<param name>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` and
  ``optimizer.param_to_group_meta.<param name>.<hyperparameter>``, by the optimizer's parameter names;
- ``opt_param_scheduler``, ``rng_state.(<pp rank>, <tp rank>)``, ``rerun_state_machine``, ``args``,
  ``checkpoint_version``, ``iteration``, ``num_floating_point_operations_so_far``.

Naming and pieces are in ``megatron/core/transformer/fsdp_dtensor_checkpoint.py``. No rank gathers anything:
each writes its own shard, and loading reads each rank's shard of the global tensors, so a checkpoint reloads at
another data-parallel size (and, the tensors being global, another tensor-parallel size). The files carry
checksums as ``torch_dcp`` ones do, and loading verifies them.

A DCP checkpoint is taken for ``fsdp_dtensor`` when its model entries have the ``module.`` of Megatron FSDP's
wrapper (Megatron-LM decides by ``--use-megatron-fsdp``; both agree on the checkpoints each writes).
"""

from megatron.core.dist_checkpointing.checkpoint_dir import CHECKPOINT_VERSION
from megatron.core.transformer.fsdp_dtensor_checkpoint import flat_piece_entries, global_param_names

FSDP_DTENSOR = "fsdp_dtensor"


def _distributed_members(optimizer) -> list:
    if optimizer is None:
        raise ValueError(
            "--ckpt-format fsdp_dtensor stores the model's weights as the distributed optimizer's main parameters; "
            "build the optimizer to save or load it"
        )
    members = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for member in members:
        if not hasattr(member, "sharded_param_state_fsdp_dtensor"):
            raise ValueError(
                "--ckpt-format fsdp_dtensor stores the distributed optimizer's shards; this run's optimizer is a "
                f"{type(member).__name__} (use a sharded --data-parallel-sharding-strategy, or --ckpt-format "
                "torch_dist)"
            )
    return members


def _unwrapped(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def model_entries(chunk, optimizer) -> dict:
    """The model part of one chunk: this rank's pieces of the main weights, by Megatron FSDP's state-dict names."""
    names = global_param_names(chunk, root=_unwrapped(chunk))
    gated = getattr(chunk.config, "gated_linear_unit", False)
    entries = {}
    for member in _distributed_members(optimizer):
        for model_param, main_param, start in member.fsdp_dtensor_main_params():
            if model_param in names:
                key = f"module.{names[model_param]}"
                entries.update(flat_piece_entries(key, model_param, main_param, start, gated))
    return entries


def optimizer_entries(optimizer, is_loading: bool) -> dict:
    """Every distributed optimizer's ``fsdp_dtensor`` state merged (their parameter names do not overlap)."""
    merged = {"state": {}, "param_to_group_meta": {}}
    for member in _distributed_members(optimizer):
        part = member.sharded_param_state_fsdp_dtensor(is_loading)
        merged["state"].update(part.pop("state"))
        merged["param_to_group_meta"].update(part.pop("param_to_group_meta"))
        merged.update(part)
    return merged


def fsdp_dtensor_state_dict(
    args, model, optimizer, opt_param_scheduler, rng_state, iteration=None, rerun_state=None, is_loading=False
) -> dict:
    """The checkpoint's content (see the module docstring); ``rng_state`` is ``get_rng_state("fsdp_dtensor")``'s.
    With ``is_loading`` the optimizer state is created first, for DCP to fill in place."""
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION}
    if iteration is not None:
        state["iteration"] = iteration
    for index, chunk in enumerate(model):  # model, or model0, model1, ... per virtual stage (as the other formats)
        state["model" if len(model) == 1 else f"model{index}"] = model_entries(chunk, optimizer)
    if optimizer is not None and not args.no_save_optim:
        state["optimizer"] = optimizer_entries(optimizer, is_loading)
        if opt_param_scheduler is not None:
            state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rerun_state is not None:
        state["rerun_state_machine"] = rerun_state
    if rng_state:
        state["rng_state"] = rng_state
    return state


def is_fsdp_dtensor_checkpoint(stored_keys) -> bool:
    """Whether a DCP checkpoint's keys are those of an ``fsdp_dtensor`` one (model entries behind ``module.``)."""
    return any(key.split(".", 2)[1:2] == ["module"] and key.startswith("model") for key in stored_keys)


def fsdp_dtensor_template(args, stored, ddp_model, optimizer, opt_param_scheduler, rng_state, load_optimizer) -> dict:
    """The structure to load an ``fsdp_dtensor`` checkpoint into (its entries this run reads: ``stored`` is the
    checkpoint's key set); the model and optimizer entries are this run's own tensors, filled in place."""

    def has(prefix):
        return any(key == prefix or key.startswith(prefix + ".") for key in stored)

    template_args = type(args)(**{**vars(args), "no_save_optim": not (load_optimizer and has("optimizer"))})
    rng = {key: value for key, value in (rng_state or {}).items() if has(f"rng_state.{key}")}
    template = fsdp_dtensor_state_dict(
        template_args,
        ddp_model,
        optimizer,
        opt_param_scheduler if has("opt_param_scheduler") else None,
        rng,
        iteration=0,
        is_loading=True,
    )
    for name in ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far"):
        template.pop(name, None)
        if name in stored:
            template[name] = None
    return template


def load_optimizer_entries(optimizer, loaded: dict) -> None:
    """After DCP filled the state tensors: the hyperparameters (and loss scaler) of every distributed optimizer."""
    for member in _distributed_members(optimizer):
        member.load_state_dict(loaded)


def publish_main_params(optimizer) -> None:
    """The loaded main weights become the model's: written into the parameter shards, gathered where the layout
    keeps whole parameters (at once, or before the next forward with --overlap-param-gather)."""
    import torch

    for member in _distributed_members(optimizer):
        with torch.no_grad():
            member._copy_main_params_to_model_params()
        for chunk in member.model_chunks:
            chunk.mark_params_updated(member.buffers)
