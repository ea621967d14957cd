"""Context parallelism: core attention over a sequence sharded across the context-parallel group.

:class:`ContextParallelAttention` is what ``DotProductAttention`` runs when ``context_parallel_size > 1``;
:func:`ring_attention` is the ring (``p2p``) kernel on its own.
"""

from megatron.core.transformer.context_parallel.batch import zigzag_chunk_ids
from megatron.core.transformer.context_parallel.cp_attention import ContextParallelAttention
from megatron.core.transformer.context_parallel.ring_attention import RingLayout, ring_attention
from megatron.core.transformer.enums import CP_COMM_TYPES

__all__ = ["CP_COMM_TYPES", "ContextParallelAttention", "RingLayout", "ring_attention", "zigzag_chunk_ids"]
