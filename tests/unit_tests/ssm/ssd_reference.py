"""The SSD recurrence written literally from its definition, one time step at a time (the tests' reference).

state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t B_t^T        (per head h; B, C of group h // (H / G))
y_t     = state_t C_t + D_h * x_t
"""

import torch


def sequential_ssd(x, dt, A, B, C, D=None, initial_state=None):
    """``(y [b, l, h, p], final state [b, h, p, n])`` by a Python loop over time, in x's dtype."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, d_state = B.shape[2], B.shape[3]
    heads_per_group = nheads // ngroups
    if initial_state is None:
        state = torch.zeros(batch, nheads, headdim, d_state, dtype=x.dtype)
    else:
        state = initial_state.to(x.dtype)
    outputs = []
    for t in range(seqlen):
        B_t = B[:, t].repeat_interleave(heads_per_group, dim=1)  # [b, h, n]
        C_t = C[:, t].repeat_interleave(heads_per_group, dim=1)
        decay = torch.exp(dt[:, t] * A)  # [b, h]
        state = decay[:, :, None, None] * state + dt[:, t, :, None, None] * x[:, t, :, :, None] * B_t[:, :, None, :]
        y_t = (state * C_t[:, :, None, :]).sum(-1)
        if D is not None:
            y_t = y_t + (D[:, None] if D.dim() == 1 else D) * x[:, t]
        outputs.append(y_t)
    return torch.stack(outputs, dim=1), state
