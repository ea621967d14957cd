"""Point-to-point communication between neighbouring pipeline stages: :class:`P2PCommunicator`.

A communicator serves one pipeline process group. Every exchange is one *call*: a rank posts all of its sends and
receives for that step together, then waits for them. Activations travel forward (to the next stage) and
gradients backward (to the previous stage). Within a call the operations are always posted in the same order,
activations before gradients::

    send to next (activation), recv from prev (activation), send to prev (gradient), recv from next (gradient)

With two stages the previous and the next rank are the same peer, so one channel carries both activations and
gradients. Messages on a channel are matched first-in first-out (on gloo and on NCCL alike), and because the
sender posts its activation before its gradient while the receiver posts its activation receive before its
gradient receive, the two can never be swapped.

With ``variable_seq_lengths`` each call is preceded by an exchange of the tensors' shapes, so a receiver can size
its buffer; otherwise every tensor must have exactly ``tensor_shape``, and a stage output of another shape is an
error rather than a silent mismatch (a plain send names no shape, so there only the dtype is checked).

The methods that name a single direction (``recv_forward``, ``send_backward``, ...) do nothing on a stage with
no neighbour in that direction: the first stage receives no activation, the last sends none. They take either
one tensor and one shape, or lists of them (one entry per tensor a stage exchanges; a ``None`` shape or tensor
is skipped), and answer in the same form.
"""

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import utils as pp_utils
from megatron.core.utils import get_current_device

Shape = Union[List[int], torch.Size]


def is_single_shape(x) -> bool:
    """Whether ``x`` is one tensor shape (a ``torch.Size`` or a list/tuple of ints), not a list of shapes."""
    if isinstance(x, torch.Size):
        return True
    return isinstance(x, (list, tuple)) and all(isinstance(d, int) for d in x)


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


def _check_sent_tensor(
    tensor: torch.Tensor, what: str, tensor_shape: Optional[Shape], config: ModelParallelConfig
) -> None:
    if tensor.dtype != config.pipeline_dtype:
        raise ValueError(
            f"the {what} has dtype {tensor.dtype} but config.pipeline_dtype is {config.pipeline_dtype}; "
            "the receiving stage would misread it. Make the stage output pipeline_dtype or change pipeline_dtype"
        )
    if tensor_shape is None:  # a plain send names no shape; the tensor's own is what travels
        return
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


def _as_list(x) -> Tuple[list, bool]:
    """``(items, was_single)``: a lone tensor or shape becomes a one-element list."""
    if isinstance(x, list) and not is_single_shape(x):
        return x, False
    if isinstance(x, list) and not x:
        return x, False
    return [x], True


class P2PCommunicator:
    """Sends and receives pipeline activations and gradients within ``pp_group``, as ``config`` describes
    (``pipeline_dtype``, ``variable_seq_lengths``, ``batch_p2p_comm``).

    The previous and next stages wrap around the ring of the group's ranks, which is what the interleaved
    schedule's virtual stages need; the single-direction methods take ``is_first_stage`` / ``is_last_stage``
    from the caller, which knows the model chunk (virtual stage) being run.
    """

    def __init__(self, pp_group: dist.ProcessGroup, config: ModelParallelConfig):
        self.pp_group = pp_group
        self.config = config
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size

    @property
    def is_pp_first_stage(self) -> bool:
        return pp_utils.is_pp_first_stage(self.pp_group)

    @property
    def is_pp_last_stage(self) -> bool:
        return pp_utils.is_pp_last_stage(self.pp_group)

    @property
    def total_stages(self) -> int:
        """Number of pipeline stages (ranks of the group)."""
        return self.pp_group.size()

    @property
    def current_stage(self) -> int:
        """This rank's stage, 0-based."""
        return self.pp_group.rank()

    # ---- the primitive call -------------------------------------------------------------------------------

    def _post(
        self,
        *,
        send_next: Optional[torch.Tensor],
        recv_prev: Optional[torch.Tensor],
        send_prev: Optional[torch.Tensor],
        recv_next: Optional[torch.Tensor],
    ) -> List[dist.Work]:
        """Post the four (optional) operations of one call in the fixed order; return their requests."""
        group = self.pp_group
        next_rank = pp_utils.get_pp_next_rank(group)
        prev_rank = pp_utils.get_pp_prev_rank(group)
        ordered = [
            (dist.isend, send_next, next_rank),
            (dist.irecv, recv_prev, prev_rank),
            (dist.isend, send_prev, prev_rank),
            (dist.irecv, recv_next, next_rank),
        ]
        if self.config.batch_p2p_comm:
            ops = [dist.P2POp(op, tensor, peer, group) for op, tensor, peer in ordered if tensor is not None]
            # Batched operations are posted together, so the odd/even reordering below is not needed.
            return dist.batch_isend_irecv(ops) if ops else []
        # Unbatched operations may each block until the peer posts its match (NCCL), so neighbours must not both
        # start with a send: odd ranks receive first. The order per channel stays activation-then-gradient.
        if group.rank() % 2 == 1:
            ordered = [ordered[1], ordered[0], ordered[3], ordered[2]]
        return [op(tensor, peer, group) for op, tensor, peer in ordered if tensor is not None]

    def _exchange_shapes(
        self,
        send_next: Optional[torch.Tensor],
        send_prev: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
        ndim: int,
    ) -> Tuple[Optional[List[int]], Optional[List[int]]]:
        """Tell the neighbours the shapes about to be sent; learn the shapes about to be received."""
        device = get_current_device()

        def shape_of(tensor):
            # Shapes travel as int64 tensors because p2p only moves tensors.
            return None if tensor is None else torch.tensor(tensor.shape, dtype=torch.int64, device=device)

        def buffer(wanted):
            # Only the sizes vary: the receiver's number of dimensions comes from tensor_shape.
            return torch.empty(ndim, dtype=torch.int64, device=device) if wanted else None

        prev_shape, next_shape = buffer(recv_prev), buffer(recv_next)
        requests = self._post(
            send_next=shape_of(send_next), recv_prev=prev_shape, send_prev=shape_of(send_prev), recv_next=next_shape
        )
        # Wait now: the caller sizes its receive buffers from these shapes.
        for request in requests:
            request.wait()
        return (
            None if prev_shape is None else prev_shape.tolist(),
            None if next_shape is None else next_shape.tolist(),
        )

    def _communicate(
        self,
        *,
        tensor_send_next: Optional[torch.Tensor],
        tensor_send_prev: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Optional[Shape],
        wait_on_reqs: bool = True,
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], List[dist.Work]]:
        """One call: send to either neighbour and receive from either, all posted at once.

        Returns ``(tensor_recv_prev, tensor_recv_next, requests)``. The requests are already complete unless
        ``wait_on_reqs=False``, in which case the caller must wait on them before reading the received tensors or
        reusing the sent ones. A received activation requires grad, so the stage's backward pass yields its
        gradient. ``tensor_shape`` may be None only for a call that receives nothing.
        """
        config = self.config
        _check_config(config)
        if (recv_prev or recv_next) and tensor_shape is None:
            raise ValueError("a pipeline receive needs tensor_shape (the shape of the tensor to receive)")
        if tensor_send_next is not None:
            _check_sent_tensor(tensor_send_next, "activation sent to the next stage", tensor_shape, config)
            # isend/irecv move a dense buffer; a non-contiguous view (e.g. a transpose) cannot be sent as is.
            tensor_send_next = tensor_send_next.contiguous()
        if tensor_send_prev is not None:
            _check_sent_tensor(tensor_send_prev, "gradient sent to the previous stage", tensor_shape, config)
            tensor_send_prev = tensor_send_prev.contiguous()

        prev_shape = next_shape = tensor_shape
        if config.variable_seq_lengths:
            ndim = len(tensor_shape) if tensor_shape is not None else 0
            prev_shape, next_shape = self._exchange_shapes(
                tensor_send_next, tensor_send_prev, recv_prev, recv_next, ndim
            )

        device = get_current_device()
        dtype = config.pipeline_dtype
        tensor_recv_prev = (
            # A leaf requiring grad: this stage's backward then fills its .grad, the gradient sent back.
            torch.empty(prev_shape, dtype=dtype, device=device, requires_grad=True) if recv_prev else None
        )
        tensor_recv_next = torch.empty(next_shape, dtype=dtype, device=device) if recv_next else None
        requests = self._post(
            send_next=tensor_send_next,
            recv_prev=tensor_recv_prev,
            send_prev=tensor_send_prev,
            recv_next=tensor_recv_next,
        )
        if wait_on_reqs:
            for request in requests:
                request.wait()
        return tensor_recv_prev, tensor_recv_next, requests

    # ---- one direction at a time (1F1B) --------------------------------------------------------------------

    def _exchange_each(
        self, sends, single: bool, shapes, at_pipeline_end: bool, send_to_next: bool, recv_from_next: bool
    ):
        """One exchange per shape: send ``sends[i]`` (None sends nothing) to the next or the previous stage and
        receive a tensor of that shape from the next or the previous stage; None where the shape is None or this
        stage is at the pipeline's end in that direction. A single result unless the inputs were lists."""
        received = []
        for tensor, shape in zip(sends, shapes):
            if shape is None or at_pipeline_end:
                received.append(None)
                continue
            from_prev, from_next, _ = self._communicate(
                tensor_send_next=tensor if send_to_next else None,
                tensor_send_prev=None if send_to_next else tensor,
                recv_prev=not recv_from_next,
                recv_next=recv_from_next,
                tensor_shape=shape,
            )
            received.append(from_next if recv_from_next else from_prev)
        return received[0] if single else received

    def recv_forward(self, tensor_shapes, is_first_stage: bool) -> Union[torch.Tensor, list[torch.Tensor]]:
        """Receive this stage's input activation(s) from the previous stage (None on the first stage)."""
        shapes, single = _as_list(tensor_shapes)
        return self._exchange_each(
            [None] * len(shapes), single, shapes, is_first_stage, send_to_next=False, recv_from_next=False
        )

    def recv_backward(self, tensor_shapes, is_last_stage: bool) -> Union[torch.Tensor, list[torch.Tensor]]:
        """Receive the gradient(s) of this stage's output from the next stage (None on the last stage)."""
        shapes, single = _as_list(tensor_shapes)
        return self._exchange_each(
            [None] * len(shapes), single, shapes, is_last_stage, send_to_next=False, recv_from_next=True
        )

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        """Send this stage's output activation(s) to the next stage (nothing on the last stage)."""
        if is_last_stage:
            return
        for tensor in _as_list(output_tensors)[0]:
            if tensor is not None:
                self._communicate(
                    tensor_send_next=tensor, tensor_send_prev=None, recv_prev=False, recv_next=False, tensor_shape=None
                )

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        """Send the gradient(s) of this stage's input to the previous stage (nothing on the first stage)."""
        if is_first_stage:
            return
        for grad in _as_list(input_tensor_grads)[0]:
            if grad is not None:
                self._communicate(
                    tensor_send_next=None, tensor_send_prev=grad, recv_prev=False, recv_next=False, tensor_shape=None
                )

    def send_forward_recv_backward(
        self, output_tensors, tensor_shapes, is_last_stage: bool
    ) -> Union[torch.Tensor, list[torch.Tensor]]:
        """Send output(s) to the next stage and receive their gradient(s) in one call each (None on the last)."""
        tensors, single = _as_list(output_tensors)
        return self._exchange_each(
            tensors, single, _as_list(tensor_shapes)[0], is_last_stage, send_to_next=True, recv_from_next=True
        )

    def send_backward_recv_forward(
        self, input_tensor_grads, tensor_shapes, is_first_stage: bool
    ) -> Union[torch.Tensor, list[torch.Tensor]]:
        """Send input gradient(s) to the previous stage and receive the next input(s) from it (None on the first)."""
        grads, single = _as_list(input_tensor_grads)
        return self._exchange_each(
            grads, single, _as_list(tensor_shapes)[0], is_first_stage, send_to_next=False, recv_from_next=False
        )

    # ---- around the ring (interleaved) ---------------------------------------------------------------------

    def send_forward_recv_forward(
        self, output_tensor: torch.Tensor, recv_prev: bool, tensor_shape: Shape, overlap_p2p_comm: bool = False
    ) -> torch.Tensor:
        """Send an activation to the next stage and (if ``recv_prev``) receive one from the previous stage.

        With ``overlap_p2p_comm`` returns ``(input_tensor, requests)`` without waiting.
        """
        input_tensor, _, requests = self._communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=None,
            recv_prev=recv_prev,
            recv_next=False,
            tensor_shape=tensor_shape,
            wait_on_reqs=not overlap_p2p_comm,
        )
        return (input_tensor, requests) if overlap_p2p_comm else input_tensor

    def send_backward_recv_backward(
        self, input_tensor_grad: torch.Tensor, recv_next: bool, tensor_shape: Shape, overlap_p2p_comm: bool = False
    ) -> torch.Tensor:
        """Send a gradient to the previous stage and (if ``recv_next``) receive one from the next stage.

        With ``overlap_p2p_comm`` returns ``(output_tensor_grad, requests)`` without waiting.
        """
        _, output_tensor_grad, requests = self._communicate(
            tensor_send_next=None,
            tensor_send_prev=input_tensor_grad,
            recv_prev=False,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
            wait_on_reqs=not overlap_p2p_comm,
        )
        return (output_tensor_grad, requests) if overlap_p2p_comm else output_tensor_grad

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: torch.Tensor,
        input_tensor_grad: torch.Tensor,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape,
    ) -> torch.Tensor:
        """Both directions in one call: returns ``(input_tensor, output_tensor_grad)`` (None where not received)."""
        input_tensor, output_tensor_grad, _ = self._communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )
        return input_tensor, output_tensor_grad
