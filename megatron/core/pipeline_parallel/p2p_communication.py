"""Point-to-point communication between neighbouring pipeline stages.

Every exchange is one *call*: a rank posts all of its sends and receives for that step together, then waits for
them. Activations travel forward (to the next stage) and gradients backward (to the previous stage). Within a call
the operations are always posted in the same order, activations before gradients::

    send to next (activation), recv from prev (activation), send to prev (gradient), recv from next (gradient)

With two stages the previous and the next rank are the same peer, so one channel carries both activations and
gradients. Messages on a channel are matched first-in first-out (on gloo and on NCCL alike), and because the
sender posts its activation before its gradient while the receiver posts its activation receive before its
gradient receive, the two can never be swapped.

With ``variable_seq_lengths`` each call is preceded by an exchange of the tensors' shapes, so a receiver can size
its buffer; otherwise every tensor must have exactly ``tensor_shape``, and a stage output of another shape is an
error rather than a silent mismatch.

The functions that name a single direction (``recv_forward``, ``send_backward``, ...) do nothing on a stage with
no neighbour in that direction: the first stage receives no activation, the last sends none.
"""

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.utils import get_current_device

Shape = Union[List[int], torch.Size]


def _check_config(config: ModelParallelConfig) -> None:
    if config.pipeline_dtype is None:
        raise ValueError(
            "config.pipeline_dtype is None: pipeline communication needs the dtype of the activations sent between "
            "stages; set pipeline_dtype (usually params_dtype, e.g. torch.float32 or torch.bfloat16)"
        )
    if config.use_ring_exchange_p2p:
        raise ValueError(
            "use_ring_exchange_p2p=True needs a custom ring-exchange kernel that is not available; set it to False"
        )


def _check_sent_tensor(tensor: torch.Tensor, what: str, tensor_shape: Shape, config: ModelParallelConfig) -> None:
    if tensor.dtype != config.pipeline_dtype:
        raise ValueError(
            f"the {what} has dtype {tensor.dtype} but config.pipeline_dtype is {config.pipeline_dtype}; "
            "the receiving stage would misread it. Make the stage output pipeline_dtype or change pipeline_dtype"
        )
    if config.variable_seq_lengths:
        if tensor.dim() != len(tensor_shape):
            raise ValueError(
                f"the {what} has {tensor.dim()} dimensions {tuple(tensor.shape)} but the pipeline tensor shape "
                f"{tuple(tensor_shape)} has {len(tensor_shape)}"
            )
    elif tuple(tensor.shape) != tuple(tensor_shape):
        raise ValueError(
            f"the {what} has shape {tuple(tensor.shape)} but the pipeline expects {tuple(tensor_shape)} "
            "([seq_length / context-parallel size (/ tensor-parallel size with sequence parallelism), "
            "micro_batch_size, hidden_size]); set variable_seq_lengths=True if sequence lengths vary between "
            "micro-batches, otherwise check seq_length and micro_batch_size"
        )


def _post(
    *,
    send_next: Optional[torch.Tensor],
    recv_prev: Optional[torch.Tensor],
    send_prev: Optional[torch.Tensor],
    recv_next: Optional[torch.Tensor],
    config: ModelParallelConfig,
) -> List[dist.Work]:
    """Post the four (optional) operations of one call in the fixed order; return their requests."""
    group = parallel_state.get_pipeline_model_parallel_group()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    ordered = [
        (dist.isend, send_next, next_rank),
        (dist.irecv, recv_prev, prev_rank),
        (dist.isend, send_prev, prev_rank),
        (dist.irecv, recv_next, next_rank),
    ]
    if config.batch_p2p_comm:
        ops = [dist.P2POp(op, tensor, peer, group) for op, tensor, peer in ordered if tensor is not None]
        return dist.batch_isend_irecv(ops) if ops else []
    # Unbatched operations may each block until the peer posts its match (NCCL), so neighbours must not both
    # start with a send: odd ranks receive first. The order per channel stays activation-then-gradient.
    if parallel_state.get_pipeline_model_parallel_rank() % 2 == 1:
        ordered = [ordered[1], ordered[0], ordered[3], ordered[2]]
    return [op(tensor, peer, group) for op, tensor, peer in ordered if tensor is not None]


def _exchange_shapes(
    send_next: Optional[torch.Tensor],
    send_prev: Optional[torch.Tensor],
    recv_prev: bool,
    recv_next: bool,
    ndim: int,
    config: ModelParallelConfig,
) -> Tuple[Optional[List[int]], Optional[List[int]]]:
    """Tell the neighbours the shapes about to be sent; learn the shapes about to be received."""
    device = get_current_device()

    def shape_of(tensor):
        return None if tensor is None else torch.tensor(tensor.shape, dtype=torch.int64, device=device)

    def buffer(wanted):
        return torch.empty(ndim, dtype=torch.int64, device=device) if wanted else None

    prev_shape, next_shape = buffer(recv_prev), buffer(recv_next)
    requests = _post(
        send_next=shape_of(send_next),
        recv_prev=prev_shape,
        send_prev=shape_of(send_prev),
        recv_next=next_shape,
        config=config,
    )
    for request in requests:
        request.wait()
    return (
        None if prev_shape is None else prev_shape.tolist(),
        None if next_shape is None else next_shape.tolist(),
    )


def _communicate(
    *,
    tensor_send_next: Optional[torch.Tensor],
    tensor_send_prev: Optional[torch.Tensor],
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape,
    config: ModelParallelConfig,
    wait_on_reqs: bool = True,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], List[dist.Work]]:
    """One call: send to either neighbour and receive from either, all posted at once.

    Returns ``(tensor_recv_prev, tensor_recv_next, requests)``. The requests are already complete unless
    ``wait_on_reqs=False``, in which case the caller must wait on them before reading the received tensors or
    reusing the sent ones. A received activation requires grad, so the stage's backward pass yields its gradient.
    """
    _check_config(config)
    if tensor_send_next is not None:
        _check_sent_tensor(tensor_send_next, "activation sent to the next stage", tensor_shape, config)
        tensor_send_next = tensor_send_next.contiguous()
    if tensor_send_prev is not None:
        _check_sent_tensor(tensor_send_prev, "gradient sent to the previous stage", tensor_shape, config)
        tensor_send_prev = tensor_send_prev.contiguous()

    prev_shape = next_shape = tensor_shape
    if config.variable_seq_lengths and (recv_prev or recv_next):
        prev_shape, next_shape = _exchange_shapes(
            tensor_send_next, tensor_send_prev, recv_prev, recv_next, len(tensor_shape), config
        )
    elif config.variable_seq_lengths:
        _exchange_shapes(tensor_send_next, tensor_send_prev, False, False, len(tensor_shape), config)

    device = get_current_device()
    tensor_recv_prev = (
        torch.empty(prev_shape, dtype=config.pipeline_dtype, device=device, requires_grad=True) if recv_prev else None
    )
    tensor_recv_next = torch.empty(next_shape, dtype=config.pipeline_dtype, device=device) if recv_next else None
    requests = _post(
        send_next=tensor_send_next,
        recv_prev=tensor_recv_prev,
        send_prev=tensor_send_prev,
        recv_next=tensor_recv_next,
        config=config,
    )
    if wait_on_reqs:
        for request in requests:
            request.wait()
    return tensor_recv_prev, tensor_recv_next, requests


def _first_stage(is_first_stage: Optional[bool]) -> bool:
    return parallel_state.is_pipeline_first_stage() if is_first_stage is None else is_first_stage


def _last_stage(is_last_stage: Optional[bool]) -> bool:
    return parallel_state.is_pipeline_last_stage() if is_last_stage is None else is_last_stage


def recv_forward(
    tensor_shape: Shape, config: ModelParallelConfig, is_first_stage: Optional[bool] = None
) -> Optional[torch.Tensor]:
    """Receive this stage's input activation from the previous stage (None on the first stage).

    ``is_first_stage`` defaults to ``parallel_state.is_pipeline_first_stage()`` (which honours the current
    virtual pipeline rank); the schedules pass it explicitly.
    """
    if _first_stage(is_first_stage):
        return None
    input_tensor, _, _ = _communicate(
        tensor_send_next=None,
        tensor_send_prev=None,
        recv_prev=True,
        recv_next=False,
        tensor_shape=tensor_shape,
        config=config,
    )
    return input_tensor


def recv_backward(
    tensor_shape: Shape, config: ModelParallelConfig, is_last_stage: Optional[bool] = None
) -> Optional[torch.Tensor]:
    """Receive the gradient of this stage's output from the next stage (None on the last stage)."""
    if _last_stage(is_last_stage):
        return None
    _, output_tensor_grad, _ = _communicate(
        tensor_send_next=None,
        tensor_send_prev=None,
        recv_prev=False,
        recv_next=True,
        tensor_shape=tensor_shape,
        config=config,
    )
    return output_tensor_grad


def send_forward(
    output_tensor: torch.Tensor,
    config: ModelParallelConfig,
    is_last_stage: Optional[bool] = None,
    tensor_shape: Optional[Shape] = None,
) -> None:
    """Send this stage's output activation to the next stage (nothing on the last stage)."""
    if _last_stage(is_last_stage):
        return
    _communicate(
        tensor_send_next=output_tensor,
        tensor_send_prev=None,
        recv_prev=False,
        recv_next=False,
        tensor_shape=output_tensor.shape if tensor_shape is None else tensor_shape,
        config=config,
    )


def send_backward(
    input_tensor_grad: torch.Tensor,
    config: ModelParallelConfig,
    is_first_stage: Optional[bool] = None,
    tensor_shape: Optional[Shape] = None,
) -> None:
    """Send the gradient of this stage's input to the previous stage (nothing on the first stage)."""
    if _first_stage(is_first_stage):
        return
    _communicate(
        tensor_send_next=None,
        tensor_send_prev=input_tensor_grad,
        recv_prev=False,
        recv_next=False,
        tensor_shape=input_tensor_grad.shape if tensor_shape is None else tensor_shape,
        config=config,
    )


def send_forward_recv_backward(
    output_tensor: torch.Tensor,
    tensor_shape: Shape,
    config: ModelParallelConfig,
    is_last_stage: Optional[bool] = None,
) -> Optional[torch.Tensor]:
    """Send this stage's output to the next stage and receive its gradient, in one call (None on the last stage)."""
    if _last_stage(is_last_stage):
        return None
    _, output_tensor_grad, _ = _communicate(
        tensor_send_next=output_tensor,
        tensor_send_prev=None,
        recv_prev=False,
        recv_next=True,
        tensor_shape=tensor_shape,
        config=config,
    )
    return output_tensor_grad


def send_backward_recv_forward(
    input_tensor_grad: torch.Tensor,
    tensor_shape: Shape,
    config: ModelParallelConfig,
    is_first_stage: Optional[bool] = None,
) -> Optional[torch.Tensor]:
    """Send the input gradient to the previous stage and receive the next input from it (None on the first stage)."""
    if _first_stage(is_first_stage):
        return None
    input_tensor, _, _ = _communicate(
        tensor_send_next=None,
        tensor_send_prev=input_tensor_grad,
        recv_prev=True,
        recv_next=False,
        tensor_shape=tensor_shape,
        config=config,
    )
    return input_tensor


def send_forward_recv_forward(
    output_tensor: Optional[torch.Tensor],
    recv_prev: bool,
    tensor_shape: Shape,
    config: ModelParallelConfig,
    overlap_p2p_comm: bool = False,
):
    """Send an activation to the next stage and (if ``recv_prev``) receive one from the previous stage.

    Used by the interleaved schedule, where the previous and next stage wrap around the ring of pipeline ranks.
    With ``overlap_p2p_comm`` the call returns ``(input_tensor, requests)`` without waiting.
    """
    input_tensor, _, requests = _communicate(
        tensor_send_next=output_tensor,
        tensor_send_prev=None,
        recv_prev=recv_prev,
        recv_next=False,
        tensor_shape=tensor_shape,
        config=config,
        wait_on_reqs=not overlap_p2p_comm,
    )
    return (input_tensor, requests) if overlap_p2p_comm else input_tensor


def send_backward_recv_backward(
    input_tensor_grad: Optional[torch.Tensor],
    recv_next: bool,
    tensor_shape: Shape,
    config: ModelParallelConfig,
    overlap_p2p_comm: bool = False,
):
    """Send a gradient to the previous stage and (if ``recv_next``) receive one from the next stage.

    With ``overlap_p2p_comm`` the call returns ``(output_tensor_grad, requests)`` without waiting.
    """
    _, output_tensor_grad, requests = _communicate(
        tensor_send_next=None,
        tensor_send_prev=input_tensor_grad,
        recv_prev=False,
        recv_next=recv_next,
        tensor_shape=tensor_shape,
        config=config,
        wait_on_reqs=not overlap_p2p_comm,
    )
    return (output_tensor_grad, requests) if overlap_p2p_comm else output_tensor_grad


def send_forward_backward_recv_forward_backward(
    output_tensor: Optional[torch.Tensor],
    input_tensor_grad: Optional[torch.Tensor],
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape,
    config: ModelParallelConfig,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Both directions in one call: returns ``(input_tensor, output_tensor_grad)`` (None where not received)."""
    input_tensor, output_tensor_grad, _ = _communicate(
        tensor_send_next=output_tensor,
        tensor_send_prev=input_tensor_grad,
        recv_prev=recv_prev,
        recv_next=recv_next,
        tensor_shape=tensor_shape,
        config=config,
    )
    return input_tensor, output_tensor_grad

