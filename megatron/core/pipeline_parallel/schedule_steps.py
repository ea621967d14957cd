"""The steps the pipeline schedules are made of: one micro-batch's forward pass (and loss) and backward pass through
one model chunk, and the helpers around them (freeing a sent output, the shapes stages exchange).

Megatron keeps these in ``schedules``, which re-exports them, so ``schedules.forward_step`` etc. keep working.
"""

import contextlib
from typing import Dict, Optional, Union

import torch

from megatron.core.public_api import public_api
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model, get_current_device


@public_api("megatron.core.pipeline_parallel.schedules")
def get_tensor_device(tensor: Union[torch.Tensor, Dict[str, torch.Tensor]]):
    """The device of ``tensor``, or of the first tensor of a dict of them (multi-module stage outputs)."""
    if isinstance(tensor, dict):
        if not tensor:
            raise ValueError("get_tensor_device got an empty dict of tensors")
        return next(iter(tensor.values())).device
    return tensor.device


@public_api("megatron.core.pipeline_parallel.schedules")
def custom_backward(output, grad_output):
    """Backpropagate ``grad_output`` through ``output`` without requiring their shapes to agree.

    ``torch.autograd.backward`` checks that a gradient has its output's shape; an output whose storage was freed
    after sending (``deallocate_output_tensor``) may no longer have it, while its autograd graph, which is all the
    backward pass needs, is intact. So this hands the pair to the autograd engine directly. ``grad_output=None``
    means a scalar loss (gradient one).
    """
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"custom_backward: output must be a tensor, got {type(output).__name__}")
    if grad_output is None:
        if output.numel() != 1:
            raise ValueError(
                f"custom_backward: a gradient is needed for a non-scalar output of shape {tuple(output.shape)}"
            )
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    elif not isinstance(grad_output, torch.Tensor):
        raise TypeError(f"custom_backward: grad_output must be a tensor or None, got {type(grad_output).__name__}")
    torch.autograd.graph.Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def get_model_config(model: torch.nn.Module):
    """The ``config`` of a model chunk, looking through DDP / Float16Module wrappers."""
    return get_attr_wrapped_model(model, "config")


@public_api("megatron.core.pipeline_parallel.schedules")
def deallocate_output_tensor(out: Optional[torch.Tensor], deallocate_pipeline_outputs: bool = False) -> None:
    """Free the data of a stage output that has been sent to the next stage, keeping its autograd graph.

    Only the output's ``grad_fn`` is needed for the backward pass, so its storage is replaced by a single element
    broadcast to the same shape (shape checks in ``torch.autograd.backward`` still pass). This is what keeps
    activation memory at 1F1B's bound. Does nothing unless ``deallocate_pipeline_outputs``.
    """
    if out is None or not deallocate_pipeline_outputs:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"expected the stage output to be a tensor, got {type(out).__name__}")
    if out._base is not None:
        raise ValueError(
            "the stage output is a view of another tensor, so freeing it would release no memory; return a tensor "
            "that owns its storage (e.g. .contiguous() or .clone()), or set deallocate_pipeline_outputs=False"
        )
    # Rebinding .data keeps grad_fn; the expanded one-element tensor has the old shape but no real storage.
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype).expand(out.shape)


@public_api("megatron.core.pipeline_parallel.schedules")
def check_first_val_step(first_val_step: Optional[bool], forward_only: bool, cond: bool) -> bool:
    """Whether a micro-batch counts as the first one (``first_val_step`` overrides it during validation)."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


@public_api("megatron.core.pipeline_parallel.schedules")
def get_tensor_shapes(
    *,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int,
    config,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
):
    """Shapes of the tensors sent between stages: ``[(s / cp (/ tp with sequence parallelism), b, h)]``.

    ``tp_group`` / ``cp_group`` give the tensor- and context-parallel sizes (default: ``parallel_state``'s).
    """
    del decoder_seq_length  # encoder-decoder models are not supported; decoders use seq_length
    cp_size = parallel_state.get_context_parallel_world_size() if cp_group is None else cp_group.size()
    tp_size = parallel_state.get_tensor_model_parallel_world_size() if tp_group is None else tp_group.size()
    # Context parallelism splits the sequence across CP ranks; sequence parallelism splits it again over TP.
    seq = seq_length // cp_size
    if config.sequence_parallel:
        seq //= tp_size
    return [(seq, micro_batch_size, config.hidden_size)]


@public_api("megatron.core.pipeline_parallel.schedules")
def forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    input_tensor,
    forward_data_store,
    config,
    cp_group_size,
    collect_non_loss_data=False,
    checkpoint_activations_microbatch=None,
    is_first_microbatch=False,
    current_microbatch=None,
    vp_stage=None,
    is_last_stage=True,
):
    """Run one micro-batch through one model chunk; on the last stage also compute and store its loss.

    Returns ``(output_tensors, num_tokens)``: the output as a one-element list (or a bare tensor when
    ``input_tensor`` was given bare), and the micro-batch's token count (0 for legacy losses and off the last stage).
    ``cp_group_size`` is the context-parallel size (see :func:`forward_step_calc_loss`).
    ``checkpoint_activations_microbatch`` (partial activation checkpointing) must be None and ``current_microbatch``
    (FP8 / MoE bookkeeping) is unused; both stay in Megatron's signature.
    """
    del current_microbatch
    if checkpoint_activations_microbatch is not None:
        raise ValueError(
            "checkpoint_activations_microbatch (num_microbatches_with_partial_activation_checkpoints) is not "
            "supported; leave it None"
        )
    if is_first_microbatch and hasattr(model, "set_is_first_microbatch"):
        model.set_is_first_microbatch()
    unwrap_output_tensor = not isinstance(input_tensor, list)
    if unwrap_output_tensor:
        input_tensor = [input_tensor]
    # Off the first stage the received activation replaces the embedding output as the chunk's input.
    get_attr_wrapped_model(model, "set_input_tensor")(input_tensor)

    if config.enable_autocast:
        autocast = torch.autocast(get_current_device().type, dtype=config.autocast_dtype)
    else:
        autocast = contextlib.nullcontext()
    with autocast:
        output_tensor, loss_func = forward_step_func(data_iterator, model)

    output_tensor, num_tokens = forward_step_calc_loss(
        model,
        output_tensor,
        loss_func,
        config,
        vp_stage,
        collect_non_loss_data,
        num_microbatches,
        forward_data_store,
        cp_group_size=cp_group_size,
        is_last_stage=is_last_stage,
    )
    if unwrap_output_tensor:
        return output_tensor, num_tokens
    return [output_tensor], num_tokens


@public_api("megatron.core.pipeline_parallel.schedules")
def forward_step_calc_loss(
    model,
    output_tensor,
    loss_func,
    config,
    vp_stage,
    collect_non_loss_data,
    num_microbatches,
    forward_data_store,
    cp_group_size=None,
    is_last_stage=None,
):
    """On the last stage, turn a chunk's output into the loss to backpropagate; return ``(output, num_tokens)``.

    ``loss_func(output_tensor)`` returns ``(loss, num_tokens, reduced_dict)`` (the loss summed over the tokens:
    divided here by the token count and by ``num_microbatches`` unless ``config.calculate_per_token_loss``) or the
    legacy ``(loss, reduced_dict)`` (a per-token mean on this context-parallel rank: multiplied by
    ``cp_group_size``, because the gradient reduction averages over data x context-parallel ranks, and divided by
    ``num_microbatches``). ``reduced_dict`` is appended to ``forward_data_store``; with ``collect_non_loss_data``
    it is ``loss_func(output_tensor, non_loss_data=True)`` instead. Off the last stage the output passes through
    and the token count is 0. ``is_last_stage`` / ``cp_group_size`` default to ``parallel_state``'s view.
    On every stage of an MoE model it also sets the scale of the MoE auxiliary losses' gradient for this
    micro-batch (see :func:`_set_moe_aux_loss_scale`).
    """
    del model  # Megatron reads MTP loss scalers from it; this model has none
    _set_moe_aux_loss_scale(config, num_microbatches)
    if is_last_stage is None:
        is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if cp_group_size is None:
        cp_group_size = parallel_state.get_context_parallel_world_size()
    # A device tensor: the counts are summed and then broadcast/all-reduced in finalize_model_grads.
    num_tokens = torch.zeros((), dtype=torch.int64, device=get_current_device())
    if not is_last_stage:
        return output_tensor, num_tokens
    if collect_non_loss_data:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        return output_tensor, num_tokens
    output_tensor, num_tokens, reduced = _reduce_loss(loss_func(output_tensor), num_microbatches, cp_group_size, config)
    forward_data_store.append(reduced)
    return output_tensor, num_tokens


def _set_moe_aux_loss_scale(config, num_microbatches: int) -> None:
    """Give MoE auxiliary losses (load balancing, z-loss) the same scaling as the main loss.

    The aux losses enter backward through ``MoEAuxLossAutoScaler`` (a gradient injected at the router, not a term
    added to the returned loss), so the loss scale (``config.grad_scale_func``, for fp16) and the 1/num_microbatches
    averaging that the main loss gets must be handed to it explicitly, as Megatron does; with per-token loss the
    global token count divides every gradient later (finalize_model_grads), so only the loss scale applies.
    """
    if getattr(config, "num_moe_experts", None) is None:
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    ones = torch.ones(1, device=get_current_device())
    loss_scale = config.grad_scale_func(ones) if config.grad_scale_func is not None else ones
    if not config.calculate_per_token_loss:
        loss_scale = loss_scale / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(loss_scale)


def _reduce_loss(outputs, num_microbatches: int, cp_group_size: int, config):
    """Apply Megatron's loss normalisation to what ``loss_func`` returned."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
        raise ValueError(
            "loss_func must return (loss, num_tokens, reduced_dict) or the legacy (loss, reduced_dict); "
            f"got {type(outputs).__name__} of length {len(outputs) if isinstance(outputs, (tuple, list)) else '-'}"
        )
    if len(outputs) == 2:
        loss, reduced = outputs
        return loss * cp_group_size / num_microbatches, torch.zeros((), dtype=torch.int64, device=loss.device), reduced
    loss, num_tokens, reduced = outputs
    num_tokens = torch.as_tensor(num_tokens, device=loss.device)
    if not config.calculate_per_token_loss:
        # A micro-batch whose tokens are all masked contributes zero, not NaN.
        loss = loss / num_tokens.clamp(min=1) / num_microbatches
    return loss, num_tokens.to(torch.int64), reduced


@public_api("megatron.core.pipeline_parallel.schedules")
def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """Backpropagate one micro-batch through one model chunk; return the gradient of its input.

    ``output_tensor_grad`` is None on the last stage, where the output is the loss (scaled by
    ``config.grad_scale_func`` first). Inputs and outputs may be bare tensors or one-element lists, as returned by
    :func:`forward_step`. With ``config.deallocate_pipeline_outputs`` the backward pass goes through
    :func:`custom_backward`, since a sent output's storage has been freed.
    """
    unwrap_input_tensor_grad = not isinstance(input_tensor, list)
    if unwrap_input_tensor_grad:
        input_tensor = [input_tensor]
    if not isinstance(output_tensor, list):
        output_tensor = [output_tensor]
    if not isinstance(output_tensor_grad, list):
        output_tensor_grad = [output_tensor_grad]
    for tensor in input_tensor:
        if tensor is not None:
            # This .grad is what gets sent back to the previous stage; retain it even if the input is not a leaf.
            tensor.retain_grad()

    loss_or_output = output_tensor[0]
    # No incoming gradient means this is the loss: apply the (fp16) loss scale before backward.
    if output_tensor_grad[0] is None and config.grad_scale_func is not None:
        loss_or_output = config.grad_scale_func(loss_or_output)
    if config.deallocate_pipeline_outputs:
        custom_backward(loss_or_output, output_tensor_grad[0])
    else:
        torch.autograd.backward(loss_or_output, grad_tensors=output_tensor_grad[0])

    input_tensor_grad = [None if tensor is None else tensor.grad for tensor in input_tensor]
    return input_tensor_grad[0] if unwrap_input_tensor_grad else input_tensor_grad


@public_api("megatron.core.pipeline_parallel.schedules")
def backward_step_multimodule(
    input_tensor: Dict[str, torch.Tensor],
    output_tensor: Union[torch.Tensor, Dict[str, torch.Tensor]],
    output_tensor_grad: Optional[Dict[str, torch.Tensor]],
    config,
    language_model_module_name: str,
) -> Dict[str, torch.Tensor]:
    """:func:`backward_step` for a stage of several modules (e.g. a vision encoder and a language model), whose
    tensors are dicts keyed by module name; returns the input gradients keyed the same way.

    On the last stage ``output_tensor`` is the language model's loss (a tensor, filed under
    ``language_model_module_name`` and scaled by ``config.grad_scale_func``) and ``output_tensor_grad`` is None.
    Every module's output is backpropagated in one autograd call, so modules whose graphs meet are handled too.
    Inputs (and gradients) may be one-element lists, as :func:`forward_step` hands them over.
    """

    def bare(tensor):
        if isinstance(tensor, list):
            if len(tensor) != 1:
                raise ValueError(f"expected one tensor per module, got a list of {len(tensor)}")
            return tensor[0]
        return tensor

    inputs = {name: bare(tensor) for name, tensor in input_tensor.items()}
    for tensor in inputs.values():
        if tensor is not None:
            tensor.retain_grad()
    if not isinstance(output_tensor, dict):
        output_tensor = {language_model_module_name: output_tensor}
    outputs, grads = [], []
    for name, output in output_tensor.items():
        output = bare(output)
        grad = None if output_tensor_grad is None else bare(output_tensor_grad.get(name))
        # Only the loss has no incoming gradient, so only it gets the loss scale.
        if grad is None and config.grad_scale_func is not None:
            output = config.grad_scale_func(output)
        # A module whose output carries no graph (e.g. frozen) has nothing to backpropagate.
        if output is not None and output.requires_grad:
            outputs.append(output)
            grads.append(grad)
    if outputs:
        torch.autograd.backward(outputs, grad_tensors=grads)
    return {name: None if tensor is None else tensor.grad for name, tensor in inputs.items()}


class _ForwardPasses:
    """:func:`forward_step` with what stays the same over one schedule run bound, summing the micro-batches' token
    counts and collecting their loss dicts (what the schedule returns)."""

    def __init__(
        self,
        forward_step_func,
        num_microbatches,
        config,
        cp_group_size,
        collect_non_loss_data,
        first_val_step,
        forward_only,
    ):
        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.config = config
        self.cp_group_size = cp_group_size
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.forward_only = forward_only
        self.forward_data_store = []
        self.total_num_tokens = torch.zeros((), dtype=torch.int64, device=get_current_device())

    def __call__(self, data_iterator, model, microbatch: int, input_tensor, is_last_stage: bool, vp_stage=None):
        """Micro-batch ``microbatch`` through ``model``; returns its output (the loss on the last stage)."""
        output_tensor, num_tokens = forward_step(
            self.forward_step_func,
            data_iterator,
            model,
            self.num_microbatches,
            input_tensor,
            self.forward_data_store,
            self.config,
            self.cp_group_size,
            self.collect_non_loss_data,
            is_first_microbatch=check_first_val_step(self.first_val_step, self.forward_only, microbatch == 0),
            current_microbatch=microbatch,
            vp_stage=vp_stage,
            is_last_stage=is_last_stage,
        )
        self.total_num_tokens += num_tokens
        return output_tensor
