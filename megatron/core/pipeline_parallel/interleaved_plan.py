"""The interleaved 1F1B schedule of one pipeline rank, as pure bookkeeping (no tensors, no communication).

Each rank holds ``v`` model chunks; chunk ``c`` of rank ``r`` is virtual stage ``c * p + r`` of ``v * p``. With
``m`` micro-batches a rank runs ``T = m * v`` forward and ``T`` backward passes:

* the *schedule table* (:func:`get_schedule_table`, also importable from ``schedules``, Megatron's home of it)
  orders them: groups of ``g`` micro-batches (``microbatch_group_size_per_vp_stage``, default ``p``), each group
  through chunk 0, then chunk 1, ...;
  backward pass ``k`` is forward-table entry ``k`` with its chunk mirrored (``v - 1 - c``);
* rank ``r`` warms up with ``W = min(2 (p - r - 1) + (v - 1) g, T)`` forward passes (``T`` when forward-only).

The rank's work is a sequence of *slots*. Slot ``s`` runs forward pass ``s`` (if ``s < T``), then backward pass
``s - W`` (if ``0 <= s - W < T``), then one communication call that sends what those passes produced and
receives what the next slots need. Because warm-up lengths differ by exactly two between neighbouring ranks, slot
``s`` of rank ``r`` meets slot ``s - 1`` of rank ``r + 1``: for a chain of ranks ``0 .. r`` that is slot ``s - r``,
and the last rank's slot ``s - (p - 1)`` meets the first rank's slot ``s`` around the ring (virtual stages wrap
from the last rank back to the first). So, in slot ``s``:

* a rank other than the first receives the input of its forward pass ``s + 1``; the first rank receives the
  output of the last rank's forward pass ``s - (p - 1)``, the input of the same micro-batch's next chunk;
* a rank other than the last receives the output gradient of its backward pass ``s - W + 1``; the last rank
  receives the input gradient of the first rank's backward pass ``s - W - (p - 1)``, for the previous chunk.

When few micro-batches cap some ranks' warm-up at ``T``, those ranks' backward passes start earlier than this
clock says and a message may wait for its receiver's next call; it is still matched first-in first-out on its
channel, and with two stages (where both directions share one channel) the cap never applies. The unit tests
simulate every rank's calls with rendezvous semantics to check that no message is mismatched and no rank waits
forever.

Everything received is keyed by ``(microbatch_id, model_chunk_id)``, so buffered tensors are found by name.
"""

from typing import List, Optional, Tuple
from megatron.core.public_api import public_api

Key = Tuple[int, int]  # (microbatch_id, model_chunk_id), the order of Megatron's schedule table


@public_api("megatron.core.pipeline_parallel.schedules")
def get_schedule_table(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage):
    """``(microbatch_id, model_chunk_id)`` of every forward pass of the interleaved schedule, in the order a rank
    runs them.

    Micro-batches go in groups of ``microbatch_group_size_per_vp_stage``; each group runs through chunk 0, then
    chunk 1, and so on, before the next group starts (the last group takes whatever micro-batches remain).
    """
    table = []
    for start in range(0, num_microbatches, microbatch_group_size_per_vp_stage):
        end = min(start + microbatch_group_size_per_vp_stage, num_microbatches)
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(start, end))
    return table


class InterleavedPlan:
    """What pipeline rank ``pp_rank`` computes, sends and receives in each slot of the interleaved schedule."""

    def __init__(
        self,
        *,
        num_microbatches: int,
        num_model_chunks: int,
        microbatch_group_size: Optional[int],
        pp_rank: int,
        pp_size: int,
        vp_size: Optional[int],
        forward_only: bool = False,
    ):
        group_size = pp_size if microbatch_group_size is None else microbatch_group_size
        _validate(num_microbatches, num_model_chunks, group_size, pp_size, vp_size)
        self.num_microbatches = num_microbatches
        self.num_model_chunks = num_model_chunks
        self.group_size = group_size
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.forward_only = forward_only
        self.table = get_schedule_table(num_microbatches, num_model_chunks, group_size)
        self.total = len(self.table)
        if forward_only:
            self.num_warmup = self.total
        else:
            warmup = 2 * (pp_size - pp_rank - 1) + (num_model_chunks - 1) * group_size
            self.num_warmup = min(warmup, self.total)
        self.num_slots = self.total if forward_only else self.total + self.num_warmup

    # ---- what runs where ----

    def forward_key(self, forward_id: int) -> Key:
        return self.table[forward_id]

    def backward_key(self, backward_id: int) -> Key:
        mb, chunk = self.table[backward_id]
        return mb, self.num_model_chunks - 1 - chunk

    def has_forward(self, slot: int) -> bool:
        return slot < self.total

    def has_backward(self, slot: int) -> bool:
        return not self.forward_only and 0 <= slot - self.num_warmup < self.total

    def is_first_virtual_stage(self, chunk: int) -> bool:
        return self.pp_rank == 0 and chunk == 0

    def is_last_virtual_stage(self, chunk: int) -> bool:
        return self.pp_rank == self.pp_size - 1 and chunk == self.num_model_chunks - 1

    def order(self) -> List[Tuple[str, int, int]]:
        """The rank's passes in execution order: ``('F' or 'B', microbatch_id, model_chunk_id)``."""
        passes = []
        for slot in range(self.num_slots):
            if self.has_forward(slot):
                passes.append(("F", *self.forward_key(slot)))
            if self.has_backward(slot):
                passes.append(("B", *self.backward_key(slot - self.num_warmup)))
        return passes

    # ---- what to receive at the end of a slot ----

    def activation_to_receive(self, slot: int) -> Optional[Key]:
        """Key of the activation received from the previous rank in this slot's call, or None."""
        if self.pp_rank != 0:
            return self.forward_key(slot + 1) if slot + 1 < self.total else None
        sender_forward = slot - (self.pp_size - 1)  # the last rank's forward pass that sends to us now
        if not 0 <= sender_forward < self.total:
            return None
        mb, chunk = self.forward_key(sender_forward)
        return None if chunk == self.num_model_chunks - 1 else (mb, chunk + 1)

    def gradient_to_receive(self, slot: int) -> Optional[Key]:
        """Key of the output gradient received from the next rank in this slot's call, or None."""
        if self.forward_only:
            return None
        next_backward = slot - self.num_warmup + 1
        if self.pp_rank != self.pp_size - 1:
            return self.backward_key(next_backward) if 0 <= next_backward < self.total else None
        sender_backward = next_backward - 1 - (self.pp_size - 1)  # the first rank's backward pass sending now
        if not 0 <= sender_backward < self.total:
            return None
        mb, chunk = self.backward_key(sender_backward)
        return None if chunk == 0 else (mb, chunk - 1)


def _validate(num_microbatches: int, num_model_chunks: int, group_size: int, pp_size: int, vp_size) -> None:
    if pp_size < 2:
        raise ValueError(
            f"the interleaved schedule needs pipeline_model_parallel_size > 1 (got {pp_size}); "
            "use forward_backward_no_pipelining or drop virtual_pipeline_model_parallel_size"
        )
    if vp_size is None:
        raise ValueError(
            "the interleaved schedule needs virtual_pipeline_model_parallel_size to be set in parallel_state "
            "(initialize_model_parallel(..., virtual_pipeline_model_parallel_size=v))"
        )
    if num_model_chunks != vp_size:
        raise ValueError(
            f"the interleaved schedule got {num_model_chunks} model chunks but "
            f"virtual_pipeline_model_parallel_size is {vp_size}; build one chunk per virtual stage"
        )
    if not pp_size <= group_size <= num_microbatches:
        raise ValueError(
            f"microbatch_group_size_per_vp_stage ({group_size}) must lie between pipeline_model_parallel_size "
            f"({pp_size}) and num_microbatches ({num_microbatches}); with the default (= pipeline size) the "
            "interleaved schedule needs at least as many micro-batches as pipeline stages"
        )
    remainder = num_microbatches % group_size
    if 0 < remainder < pp_size:
        raise ValueError(
            f"num_microbatches ({num_microbatches}) leaves a last group of {remainder} micro-batches "
            f"(microbatch_group_size_per_vp_stage={group_size}), fewer than pipeline_model_parallel_size "
            f"({pp_size}); the interleaved schedule needs num_microbatches to be a multiple of the group size "
            "(by default the pipeline size) or a last group of at least the pipeline size"
        )
