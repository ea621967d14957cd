"""The Mamba mixer's inference state: how it finds its conv and SSM state in an inference context, and the O(1)
single-token update of both.

A Mamba layer has no KV cache. Per request it carries, on each tensor-parallel rank, only its own heads' part:

- the **conv state** ``[conv_channels, d_conv]`` (``conv_channels`` = this rank's ``x | B | C`` channels): the last
  ``d_conv`` inputs of the causal depthwise conv, oldest first, zeros before the first token. A step shifts it left
  by one and writes the new input last, so column 0 is only the input about to drop out; the conv reads all
  ``d_conv`` columns, the new input included (mamba-ssm's convention, the shape Megatron reports);
- the **SSM state** ``[nheads, headdim, d_state]``: the scan's state after the last token.

``MambaMixer.mamba_state_shapes_per_request()`` gives both shapes; ``MambaMixer.allocate_inference_cache`` allocates
a zeroed pair for a number of request slots.

The protocol (duck-typed; Megatron's names where Megatron has them). The mixer reads from ``inference_context``:

``inference_context.is_decode_only() -> bool``
    True: every row of the batch is one new token (``hidden_states`` is ``[1, b, h]``) of a request whose states are
    stored; the mixer updates them in O(1) per token. False: prefill, every row a prompt (starting from zero states
    unless ``prefill_has_initial_states`` says otherwise); the mixer runs the chunked scan over it and stores the
    states after its last token.

``inference_context.mamba_states_cache(layer_number) -> (conv_state, ssm_state)``
    This rank's state tensors of the layer, ``[slots, *conv shape]`` and ``[slots, *SSM shape]``, which the mixer
    reads and writes in place. ``layer_number`` is the mixer's ``layer_number - pp_layer_offset`` (its 1-based number
    on this pipeline stage, as Megatron's mixer asks for it). The SSM state may be kept in fp32 (the default of
    ``allocate_inference_cache``) while the model runs in bf16; the update is computed in fp32 either way.

``inference_context.mamba_metadata`` (optional)
    Which slot each batch row uses: ``batch_indices_prefill`` (prefill) or ``batch_indices_decode`` (decode), integer
    tensors ``[b]`` of distinct, valid slots (Megatron's field names; no ``-1`` padding rows). Without it, row ``i``
    uses slot
    ``batch_size_offset + i`` (``batch_size_offset`` read from the context when it has one, else 0), Megatron's
    static-batching layout. ``prefill_lengths`` (optional, int64 ``[b]``) gives each prompt's length when prompts
    of different lengths are right-padded to one length: the states are those after each prompt's own last token
    (padding steps get ``dt = 0``, which leaves the SSM state unchanged) and outputs at padded positions are
    meaningless. Without it every row is a full-length prompt. ``prefill_has_initial_states`` (optional, bool
    ``[b]``) marks rows whose prefill continues a request from its stored states (the next piece
    of a prompt prefilled in pieces, a chunked prefill) instead of starting from zeros.
"""

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def is_decode_step(inference_context: Any) -> bool:
    """Whether the context asks for a single-token update (``is_decode_only()``), else a prefill."""
    if not callable(getattr(inference_context, "is_decode_only", None)):
        raise ValueError(
            f"MambaMixer: the inference context ({type(inference_context).__name__}) has no is_decode_only() "
            "method; a context for Mamba layers must provide is_decode_only() and mamba_states_cache(layer_number) "
            "(see megatron.core.ssm.mamba_inference)"
        )
    return bool(inference_context.is_decode_only())


def state_slots(inference_context: Any, batch: int, decode: bool, device: torch.device) -> Tensor:
    """The state slot of every batch row, int64 ``[batch]`` (see the module docstring)."""
    metadata = getattr(inference_context, "mamba_metadata", None)
    field = "batch_indices_decode" if decode else "batch_indices_prefill"
    indices = getattr(metadata, field, None) if metadata is not None else None
    if indices is None:
        offset = getattr(inference_context, "batch_size_offset", 0) or 0
        return torch.arange(offset, offset + batch, device=device)
    if tuple(indices.shape) != (batch,):
        raise ValueError(
            f"MambaMixer: inference_context.mamba_metadata.{field} must have one slot per batch row ({batch}), got "
            f"shape {tuple(indices.shape)}"
        )
    return indices.to(device=device, dtype=torch.long)


def prefill_lengths(inference_context: Any) -> Optional[Tensor]:
    """Each prompt's length when right-padded prompts of different lengths share a batch, else None."""
    metadata = getattr(inference_context, "mamba_metadata", None)
    return getattr(metadata, "prefill_lengths", None) if metadata is not None else None


def prefill_initial_states(
    inference_context: Any, conv_state: Tensor, ssm_state: Tensor, slots: Tensor
) -> Optional[Tuple[Tensor, Tensor]]:
    """``(conv inputs before the prefill [b, d_conv - 1, channels], SSM state [b, h, p, n])`` of the rows, from
    their slots where ``prefill_has_initial_states`` is set and zeros elsewhere; None when the context does not set
    it (every row starts from zeros)."""
    metadata = getattr(inference_context, "mamba_metadata", None)
    continues = getattr(metadata, "prefill_has_initial_states", None) if metadata is not None else None
    if continues is None:
        return None
    if tuple(continues.shape) != tuple(slots.shape):
        raise ValueError(
            f"MambaMixer: inference_context.mamba_metadata.prefill_has_initial_states must have one flag per batch "
            f"row ({slots.numel()}), got shape {tuple(continues.shape)}"
        )
    keep = continues.to(device=slots.device, dtype=torch.bool)
    # where, not a product: a never-written slot may hold anything, NaN included.
    conv = torch.where(keep.view(-1, 1, 1), conv_state[slots], 0.0)
    ssm = torch.where(keep.view(-1, 1, 1, 1), ssm_state[slots].float(), 0.0)
    return conv[..., 1:].transpose(1, 2), ssm


def check_state_shapes(conv_state: Tensor, ssm_state: Tensor, conv_shape, ssm_shape, layer_number) -> None:
    """One clear error when the context's state tensors do not fit this rank's mixer."""
    if tuple(conv_state.shape[1:]) != tuple(conv_shape) or tuple(ssm_state.shape[1:]) != tuple(ssm_shape):
        raise ValueError(
            f"MambaMixer (layer {layer_number}): inference_context.mamba_states_cache returned states of shapes "
            f"{tuple(conv_state.shape)} and {tuple(ssm_state.shape)}; this rank needs [slots, *{tuple(conv_shape)}] "
            f"and [slots, *{tuple(ssm_shape)}] (mamba_state_shapes_per_request(): per-rank heads and channels)"
        )


def conv_state_after_prompt(xBC: Tensor, d_conv: int, lengths: Optional[Tensor]) -> Tensor:
    """``[b, channels, d_conv]``: the last ``d_conv`` conv inputs up to each prompt's end (zeros before the first
    token), from the conv's input ``xBC [b, s, channels]``."""
    padded = F.pad(xBC, (0, 0, d_conv, 0))  # [b, d_conv + s, channels]; padded step j + d_conv is input step j
    if lengths is None:
        window = padded[:, -d_conv:]
    else:
        # Inputs lengths - d_conv .. lengths - 1 sit at padded steps lengths .. lengths + d_conv - 1.
        steps = lengths.to(xBC.device).view(-1, 1) + torch.arange(d_conv, device=xBC.device)
        window = torch.gather(padded, 1, steps.unsqueeze(-1).expand(-1, -1, xBC.shape[-1]))
    return window.transpose(1, 2)


def mask_padded_steps(dt: Tensor, lengths: Optional[Tensor]) -> Tensor:
    """``dt [b, s, h]`` with the steps past each prompt's length set to 0 (no decay, no input)."""
    if lengths is None:
        return dt
    steps = torch.arange(dt.shape[1], device=dt.device)
    return dt.masked_fill(steps.view(1, -1, 1) >= lengths.to(dt.device).view(-1, 1, 1), 0.0)


def conv_step(conv_state: Tensor, xBC: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """One causal-conv step: ``(silu(conv output) [b, channels], new conv state [b, channels, d_conv])`` for the new
    input ``xBC [b, channels]``, the rows' states ``conv_state [b, channels, d_conv]`` and the depthwise ``weight
    [channels, d_conv]``."""
    state = torch.cat([conv_state[..., 1:], xBC.unsqueeze(-1).to(conv_state.dtype)], dim=-1)
    out = (state.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(xBC.dtype), state


def ssm_step(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    """One step of the recurrence, in fp32: ``state = exp(dt A) state + dt x B^T``; ``y = state C + D x``.

    ``ssm_state [b, h, p, n]``; ``x [b, h, p]``; ``dt [b, h]`` (after softplus); ``A [h]``; ``B``, ``C [b, g, n]``
    (head ``h`` reads group ``h // (h_total / g)``); ``D [h]`` or ``[h, p]``. Returns ``(y [b, h, p] in fp32, the
    new state in fp32)``.
    """
    heads_per_group = x.shape[1] // B.shape[1]
    B = B.float().repeat_interleave(heads_per_group, dim=1)  # [b, h, n]
    C = C.float().repeat_interleave(heads_per_group, dim=1)
    x, dt = x.float(), dt.float()
    decay = torch.exp(dt * A.float())  # [b, h]
    state = ssm_state.float() * decay[..., None, None] + (dt.unsqueeze(-1) * x).unsqueeze(-1) * B.unsqueeze(2)
    y = torch.einsum("bhpn,bhn->bhp", state, C)
    if D is not None:
        D = D.float()
        y = y + x * (D.unsqueeze(-1) if D.dim() == 1 else D)
    return y, state
