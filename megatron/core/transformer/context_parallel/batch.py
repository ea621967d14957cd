"""The context-parallel split of a batch: which part of the sequence each CP rank holds.

The sequence is cut into ``2 * cp_size`` chunks and CP rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r``
(Megatron's load-balanced "zigzag" layout), so with causal attention every rank gets the same amount of work. The
context-parallel attention (``cp_attention``, ``ring_attention.RingLayout``) and the rotary embeddings read the
same layout from :func:`zigzag_chunk_ids`, so the tokens and their attention always agree.
"""

from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from megatron.core.public_api import public_api
from megatron.core import parallel_state
from megatron.core.utils import get_pg_rank, get_pg_size


def zigzag_chunk_ids(cp_size: int, cp_rank: int) -> tuple:
    """The global chunk ids (of ``2 * cp_size``) that CP rank ``cp_rank`` holds, in stored order."""
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


def chunks_of_cp_rank(tensor: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """CP rank ``cp_rank``'s part of ``tensor`` along ``seq_dim``: its two zigzag chunks, concatenated."""
    chunks = tensor.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[i] for i in zigzag_chunk_ids(cp_size, cp_rank)], dim=seq_dim)


@public_api("megatron.core.utils")
def get_batch_on_this_cp_rank(
    batch: Dict[str, Any],
    is_hybrid_cp: bool,
    cp_group: Optional[dist.ProcessGroup] = None,
    hybrid_cp_group_func: Optional[Callable[[int], dist.ProcessGroup]] = None,
    use_per_sequence_balancing: bool = False,
):
    """This context-parallel rank's part of ``batch`` (:func:`chunks_of_cp_rank`). Tensors are split along the
    sequence dimension (1, or 2 for ``attention_mask``); ``None`` values and packed-sequence metadata
    (``cu_seqlens*``, ``max_seqlen*``) are left alone. ``cp_group`` defaults to parallel_state's context-parallel
    group.
    """
    if is_hybrid_cp:
        raise ValueError("not supported yet: hybrid context parallelism (is_hybrid_cp=True)")
    if use_per_sequence_balancing:
        raise ValueError("not supported yet: per-sequence CP load balancing (use_per_sequence_balancing=True)")
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
    cp_size, cp_rank = get_pg_size(cp_group), get_pg_rank(cp_group)
    if cp_size == 1:
        return batch
    split = {}
    for key, value in batch.items():
        if value is None or not isinstance(value, torch.Tensor) or key.startswith(("cu_seqlens", "max_seqlen")):
            split[key] = value
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        length = value.shape[seq_dim]
        if length % (2 * cp_size) != 0:
            raise ValueError(
                f"batch[{key!r}] has sequence length {length} along dim {seq_dim}, not divisible by "
                f"2 x context_parallel_size = {2 * cp_size}"
            )
        split[key] = chunks_of_cp_rank(value, seq_dim, cp_size, cp_rank)
    return split
