"""Newton-Schulz orthogonalisation for Muon: the coefficient schedules, the update scale, and the tensor-parallel
variants (a TP shard orthogonalised alone, the gathered matrix orthogonalised on every rank, or the iteration's
matmuls distributed over TP).

Newton-Schulz maps a matrix ``G = U S V^T`` to roughly ``U V^T`` with matrix products only: after scaling ``G`` to a
Frobenius norm of one (so every singular value is at most one), each step applies the odd polynomial
``X <- a X + b (X X^T) X + c (X X^T)^2 X``, which pushes every singular value towards one. The coefficient sets are
published numbers: Keller Jordan's Muon ("simple", repeated every step), the five-step schedule tuned for
modded-nanogpt ("quintic", Megatron's default), Polar Express (arXiv:2505.16932, eight steps, the last repeated)
and the AOL schedule of flash-newton-schulz ("aol"). They do not converge to exactly one: singular values end in a
band around it (five "simple" steps: about 0.7 to 1.15; the tuned schedules: within a few percent), which is all
Muon needs.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

NS_COEFFICIENT_SETS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}

_NORM_EPS = 1e-7


def ns_coefficients(coefficient_type: str, steps: int) -> List[Tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` Newton-Schulz steps."""
    if coefficient_type not in NS_COEFFICIENT_SETS:
        raise ValueError(
            f"unknown Newton-Schulz coefficient type {coefficient_type!r}; use one of {tuple(NS_COEFFICIENT_SETS)}"
        )
    sets = NS_COEFFICIENT_SETS[coefficient_type]
    if coefficient_type == "simple":
        return sets * steps
    if coefficient_type == "polar_express":
        if steps < len(sets):
            raise ValueError(f"polar_express needs at least {len(sets)} Newton-Schulz steps, got {steps}")
        return sets + [sets[-1]] * (steps - len(sets))
    if steps % len(sets):
        raise ValueError(f"{coefficient_type} needs a multiple of {len(sets)} Newton-Schulz steps, got {steps}")
    return sets * (steps // len(sets))


def newton_schulz(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str = "quintic",
    transpose: Optional[bool] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    low_precision: bool = False,
) -> torch.Tensor:
    """Orthogonalise the 2-D ``x`` (fp32 in and out).

    The iteration runs on the orientation with fewer rows (``transpose`` None picks it), so ``X X^T`` is the small
    Gram matrix. With ``tp_group``, ``x`` is this rank's slice of a matrix split along its long side (the columns
    after the transpose): the norm and each Gram matrix are summed over the group, every other product is local.
    ``low_precision`` runs the steps in bfloat16 (Megatron's ``fp32_matmul_prec`` 'medium'/'low').
    """
    if x.dim() != 2:
        raise ValueError(f"Newton-Schulz orthogonalises 2-D matrices; got a tensor of shape {tuple(x.shape)}")
    if transpose is None:
        transpose = x.size(0) > x.size(1)
    matrix = x.float().mT if transpose else x.float()
    squared_norm = (matrix * matrix).sum()
    if tp_group is not None:
        dist.all_reduce(squared_norm, group=tp_group)
    matrix = matrix / squared_norm.sqrt().clamp_min(_NORM_EPS)
    if low_precision:
        matrix = matrix.to(torch.bfloat16)
    for a, b, c in ns_coefficients(coefficient_type, steps):
        gram = matrix @ matrix.mT
        if tp_group is not None:
            dist.all_reduce(gram, group=tp_group)
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        matrix = torch.addmm(matrix, polynomial, matrix, beta=a, alpha=1.0)
    matrix = matrix.float()
    return matrix.mT if transpose else matrix


def newton_schulz_tp(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str,
    tp_group: Optional[dist.ProcessGroup],
    partition_dim: Optional[int] = None,
    mode: str = "duplicated",
    low_precision: bool = False,
) -> torch.Tensor:
    """Orthogonalise this rank's shard of a matrix split along ``partition_dim`` over ``tp_group`` as part of the
    whole matrix: 'duplicated' gathers the whole matrix, orthogonalises it on every rank and keeps this rank's
    slice; 'distributed' runs the iteration on the shards. ``partition_dim`` None (not split, or 'blockwise')
    orthogonalises ``x`` alone."""
    if partition_dim is None or tp_group is None or dist.get_world_size(tp_group) == 1:
        return newton_schulz(x, steps, coefficient_type, low_precision=low_precision)
    if mode == "duplicated":
        shards = [torch.empty_like(x) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(shards, x.contiguous(), group=tp_group)
        whole = newton_schulz(
            torch.cat(shards, dim=partition_dim), steps, coefficient_type, low_precision=low_precision
        )
        return whole.chunk(len(shards), dim=partition_dim)[dist.get_rank(tp_group)].contiguous()
    if mode == "distributed":
        # The split side becomes the columns, so each Gram matrix is a sum of per-shard products.
        return newton_schulz(
            x, steps, coefficient_type, transpose=partition_dim == 0, tp_group=tp_group, low_precision=low_precision
        )
    raise ValueError(f"unknown Muon tensor-parallel mode {mode!r}; use 'blockwise', 'duplicated' or 'distributed'")


def get_muon_scale_factor(size_out: int, size_in: int, mode: str = "spectral") -> float:
    """The factor the orthogonalised update of a ``size_out x size_in`` matrix is multiplied by: 'spectral'
    ``sqrt(max(out, in))`` (Kimi's Moonlight scaling), 'unit_rms_norm' ``sqrt(out / in)`` (Scion), 'shape_scaling'
    ``sqrt(max(1, out / in))`` (Keller Jordan's Muon)."""
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, size_out / size_in) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r}; use 'spectral', 'unit_rms_norm' or 'shape_scaling'")


def split_qkv_rows(tensor: torch.Tensor, split_shapes: Sequence[int]) -> List[torch.Tensor]:
    """The q, k and v matrices of a fused ``linear_qkv`` weight (or gradient) laid out per query group as
    ``[groups x (q rows, k rows, v rows), hidden]``: each part collects its rows of every group."""
    per_group = sum(split_shapes)
    grouped = tensor.view(tensor.size(0) // per_group, per_group, tensor.size(1))
    return [part.reshape(-1, tensor.size(1)) for part in torch.split(grouped, list(split_shapes), dim=1)]


def join_qkv_rows(parts: Sequence[torch.Tensor], split_shapes: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`split_qkv_rows`."""
    hidden = parts[0].size(1)
    groups = parts[0].size(0) // split_shapes[0]
    grouped = [part.view(groups, rows, hidden) for part, rows in zip(parts, split_shapes)]
    return torch.cat(grouped, dim=1).view(-1, hidden)
