"""The Mamba-2 SSD scan in plain PyTorch: the chunked algorithm of Dao & Gu (arXiv 2405.21060), the reference.

Per head ``h`` (scalar decay ``A_h < 0``) and time step ``t``, with ``dt_t > 0``::

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t B_t^T          state: [headdim, d_state]
    y_t     = state_t C_t + D_h * x_t

where head ``h`` reads the ``B`` / ``C`` of group ``h // (nheads / ngroups)``. Computed step by step this is a loop
of ``seqlen`` small products; the chunked form splits the sequence into chunks of ``chunk_size`` and computes

1. inside each chunk, the outputs as a causal, decay-weighted "attention" ``(C B^T o L) (dt x)``, where
   ``L[i, j] = exp(sum_{j < k <= i} dt_k A)`` -- one batched matmul per chunk;
2. the state each chunk leaves behind, ``sum_l exp(sum_{l < k <= last} dt_k A) B_l (dt_l x_l)^T``;
3. the state entering each chunk, by decaying and summing the states of the chunks before it (a small
   ``[chunks x chunks]`` lower-triangular product, so there is no loop over chunks either);
4. what those entering states contribute to each output, ``C_t state_in exp(sum_{first <= k <= t} dt_k A)``,

and ``y = (1) + (4) + D x``. All of it is matmuls and cumulative sums, so autograd gives the gradients, and it runs on
any device. The decay matrices (steps within a chunk, chunks within the sequence) are cumulative sums of masked
copies (:func:`segsum`), not differences of one running sum, so no entry suffers cancellation. A sequence length
that is not a multiple of ``chunk_size`` is padded at the end with ``dt = 0`` steps (no decay, no input): they change
neither the outputs before them nor the final state. Inputs in bf16 / fp16 are computed in fp32 (fp64 stays fp64) and
the output is returned in the input's dtype, as the fused kernels do.

The arguments follow mamba-ssm's ``mamba_chunk_scan_combined`` (same layout, same names), so the fused kernel is a
drop-in replacement (see :mod:`megatron.core.ssm.ssd_kernels`).
"""

import functools
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@functools.lru_cache(maxsize=16)
def _lower_triangular_masks(length: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """``(i > j, i >= j)`` as ``[length, length]`` bool masks (cached: every chunk and layer uses the same ones)."""
    steps = torch.arange(length, device=device)
    return steps[:, None] > steps[None, :], steps[:, None] >= steps[None, :]


def segsum(log_decay: Tensor) -> Tensor:
    """``out[..., i, j] = sum_{j < k <= i} log_decay[..., k]`` for ``i >= j`` and ``-inf`` above the diagonal.

    ``exp(segsum(a))`` is the lower-triangular matrix of decays from step ``j`` to step ``i``. Built by a cumulative
    sum down the rows of a masked copy, so every entry is a sum of the terms it covers, without cancellation.
    """
    length = log_decay.size(-1)
    strictly_lower, lower = _lower_triangular_masks(length, log_decay.device)
    repeated = log_decay.unsqueeze(-1).expand(*log_decay.shape, length)  # [..., i, j] = a_i
    sums = torch.cumsum(repeated.masked_fill(~strictly_lower, 0.0), dim=-2)
    return sums.masked_fill(~lower, float("-inf"))


def _check_shapes(x, dt, A, B, C, chunk_size, D, z, initial_states):
    if x.dim() != 4:
        raise ValueError(f"ssd_chunked_scan: x must be [batch, seqlen, nheads, headdim], got shape {tuple(x.shape)}")
    batch, seqlen, nheads, headdim = x.shape
    if tuple(dt.shape) != (batch, seqlen, nheads):
        raise ValueError(f"ssd_chunked_scan: dt must be {(batch, seqlen, nheads)}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (nheads,):
        raise ValueError(f"ssd_chunked_scan: A must be [nheads]={nheads}, got {tuple(A.shape)}")
    if B.dim() != 4 or tuple(B.shape[:2]) != (batch, seqlen) or B.shape != C.shape:
        raise ValueError(
            f"ssd_chunked_scan: B and C must both be [batch, seqlen, ngroups, d_state] with batch={batch}, "
            f"seqlen={seqlen}; got {tuple(B.shape)} and {tuple(C.shape)}"
        )
    if nheads % B.shape[2] != 0:
        raise ValueError(f"ssd_chunked_scan: nheads ({nheads}) must be a multiple of ngroups ({B.shape[2]})")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"ssd_chunked_scan: chunk_size must be a positive integer, got {chunk_size!r}")
    if D is not None and tuple(D.shape) not in ((nheads,), (nheads, headdim)):
        raise ValueError(f"ssd_chunked_scan: D must be [nheads] or [nheads, headdim], got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"ssd_chunked_scan: z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    expected_state = (batch, nheads, headdim, B.shape[3])
    if initial_states is not None and tuple(initial_states.shape) != expected_state:
        raise ValueError(
            f"ssd_chunked_scan: initial_states must be {expected_state}, got {tuple(initial_states.shape)}"
        )


def ssd_chunked_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Optional[Tensor] = None,
    z: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    initial_states: Optional[Tensor] = None,
    dt_softplus: bool = False,
    dt_limit: Tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    states_dtype: Optional[torch.dtype] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """The SSD scan: ``y [batch, seqlen, nheads, headdim]`` (and the final state ``[batch, nheads, headdim,
    d_state]`` with ``return_final_states``).

    ``x [b, l, h, p]``; ``dt [b, l, h]`` (``dt + dt_bias``, then softplus with ``dt_softplus``, then clamped to
    ``dt_limit``); ``A [h]`` (negative); ``B``, ``C [b, l, g, n]``; ``D [h]`` or ``[h, p]`` adds ``D * x``; ``z``
    (x's shape) gates the output by ``silu(z)``; ``initial_states`` is the state before the first step.
    ``states_dtype`` rounds the states passed between chunks to that dtype (a memory/precision trade the fused
    kernels offer); by default they stay in fp32. The final state is returned in fp32 (fp64 for fp64 inputs).
    """
    _check_shapes(x, dt, A, B, C, chunk_size, D, z, initial_states)
    out_dtype = x.dtype
    # Half-precision inputs are computed in fp32; fp64 stays fp64.
    compute = torch.promote_types(x.dtype, torch.float32)
    batch, seqlen, nheads, headdim = x.shape
    ngroups, d_state = B.shape[2], B.shape[3]
    heads_per_group = nheads // ngroups

    dt = dt.to(compute)
    if dt_bias is not None:
        dt = dt + dt_bias.to(compute)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    x_in, B, C = x.to(compute), B.to(compute), C.to(compute)

    pad = (-seqlen) % chunk_size
    if pad:
        # dt = 0 steps neither decay nor add to the state; they sit after every real step.
        x_in, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x_in, dt, B, C))
    chunks = (seqlen + pad) // chunk_size

    # [b, c, Q, g, hpg, p]: heads grouped by the B/C group they read.
    xdt = (x_in * dt.unsqueeze(-1)).view(batch, chunks, chunk_size, ngroups, heads_per_group, headdim)
    B = B.view(batch, chunks, chunk_size, ngroups, d_state)
    C = C.view(batch, chunks, chunk_size, ngroups, d_state)
    # Log-decay of every step, [b, h, c, Q], and its running sum inside each chunk.
    log_decay = (dt * A.to(compute)).view(batch, chunks, chunk_size, nheads).permute(0, 3, 1, 2)
    cum_decay = torch.cumsum(log_decay, dim=-1)

    def by_group(t: Tensor) -> Tensor:  # [b, h, ...] -> [b, g, hpg, ...]
        return t.view(batch, ngroups, heads_per_group, *t.shape[2:])

    # 1. Within each chunk.
    decay_matrix = by_group(torch.exp(segsum(log_decay)))  # [b, g, hpg, c, Q(i), Q(j)]
    scores = torch.einsum("bcign,bcjgn->bcgij", C, B)
    y_intra = torch.einsum("bcgij,bgkcij,bcjgkp->bcigkp", scores, decay_matrix, xdt)

    # 2. The state each chunk leaves: inputs decayed to the chunk's last step.
    decay_to_end = by_group(torch.exp(cum_decay[..., -1:] - cum_decay))  # [b, g, hpg, c, Q]
    chunk_states = torch.einsum("bcjgn,bgkcj,bcjgkp->bcgkpn", B, decay_to_end, xdt)
    chunk_states = chunk_states.reshape(batch, chunks, nheads, headdim, d_state)

    # 3. The state entering each chunk: earlier chunks' states, decayed across the chunks in between.
    if initial_states is None:
        initial_states = torch.zeros(batch, nheads, headdim, d_state, dtype=compute, device=x.device)
    states = torch.cat([initial_states.to(compute).unsqueeze(1), chunk_states], dim=1)  # [b, c + 1, h, p, n]
    chunk_log_decay = F.pad(cum_decay[..., -1], (1, 0))  # [b, h, c + 1]
    across_chunks = torch.exp(segsum(chunk_log_decay))  # [b, h, c + 1, c + 1]
    states = torch.einsum("bhzc,bchpn->bzhpn", across_chunks, states)
    if states_dtype is not None:
        states = states.to(states_dtype).to(compute)
    entering, final_states = states[:, :-1], states[:, -1]

    # 4. What the entering state adds to each step of the chunk.
    decay_from_start = by_group(torch.exp(cum_decay))  # [b, g, hpg, c, Q]
    entering = entering.reshape(batch, chunks, ngroups, heads_per_group, headdim, d_state)
    y_inter = torch.einsum("bcign,bcgkpn,bgkci->bcigkp", C, entering, decay_from_start)

    y = (y_intra + y_inter).reshape(batch, chunks * chunk_size, nheads, headdim)[:, :seqlen]
    if D is not None:
        D = D.to(compute)
        y = y + x.to(compute) * (D.unsqueeze(-1) if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z.to(compute))
    y = y.to(out_dtype)
    return (y, final_states) if return_final_states else y
