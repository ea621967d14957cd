"""PackedSeqParams: how several sequences are packed into one row (the ``thd`` layout) for attention."""

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist


@dataclass
class PackedSeqParams:
    """Boundaries of the sequences packed into a batch, passed to attention as ``packed_seq_params``.

    ``qkv_format``: ``'thd'`` (tokens of all sequences concatenated) or ``'sbhd'``/``'bshd'``.
    ``cu_seqlens_q`` / ``cu_seqlens_kv``: int32 cumulative sequence lengths ``[0, l0, l0+l1, ...]`` of the queries
    and keys/values; the ``*_padded`` variants count each sequence padded (e.g. to a multiple of 2 x CP size).
    ``max_seqlen_q`` / ``max_seqlen_kv``: the longest sequence. ``local_cp_size`` / ``cp_group``: the context-parallel
    size and group for this batch when it differs per batch. ``total_tokens``: tokens in the packed batch.
    ``seq_idx``: per-token sequence index (for Mamba's packed scans). ``tokens_per_sample``: sequence lengths as a
    list. ``pad_between_seqs``: whether sequences are padded individually (the padded cu_seqlens differ).
    """

    qkv_format: Optional[str] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    local_cp_size: Optional[int] = None
    cp_group: Optional[dist.ProcessGroup] = None
    total_tokens: Optional[int] = None
    seq_idx: Optional[torch.Tensor] = None
    tokens_per_sample: Optional[List[int]] = None
    pad_between_seqs: Optional[bool] = None
