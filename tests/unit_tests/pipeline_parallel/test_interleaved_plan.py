"""The interleaved schedule's plan, checked without communication: table, warm-up, every send meeting its receive.

The ring simulation below runs every rank's sequence of calls with rendezvous semantics and first-in first-out
matching per pair of ranks, and checks that every message lands where its receiver expects it, that every tensor
arrives before the pass that needs it, and that no set of ranks waits on each other forever.
"""

import pytest

from megatron.core.pipeline_parallel.interleaved_plan import InterleavedPlan
from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table


def _plans(pp, vp, m, group=None, forward_only=False):
    return [
        InterleavedPlan(
            num_microbatches=m,
            num_model_chunks=vp,
            microbatch_group_size=group,
            pp_rank=rank,
            pp_size=pp,
            vp_size=vp,
            forward_only=forward_only,
        )
        for rank in range(pp)
    ]


def test_schedule_table_groups_microbatches_per_chunk():
    assert get_schedule_table(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    # A last, larger-than-pipeline group takes the remaining micro-batches.
    assert get_schedule_table(5, 2, 3) == [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 0),
        (4, 0),
        (3, 1),
        (4, 1),
    ]


def test_warmup_follows_the_published_formula():
    # 2 (p - r - 1) + (v - 1) * g, capped at the total number of passes m * v.
    assert [plan.num_warmup for plan in _plans(4, 2, 8)] == [10, 8, 6, 4]
    assert [plan.num_warmup for plan in _plans(4, 2, 4)] == [8, 8, 6, 4]
    assert [plan.num_warmup for plan in _plans(4, 3, 9, group=5)] == [16, 14, 12, 10]
    assert [plan.num_warmup for plan in _plans(2, 2, 4, forward_only=True)] == [8, 8]


class _Stages:
    """What get_pp_rank_microbatches reads from a P2PCommunicator."""

    def __init__(self, rank, size, vp_size):
        self.current_stage, self.total_stages, self.virtual_pipeline_model_parallel_size = rank, size, vp_size


@pytest.mark.parametrize("forward_only", [False, True])
def test_get_pp_rank_microbatches_matches_the_plan(forward_only):
    for pp, vp, m, group in [(4, 2, 8, 4), (4, 2, 4, 4), (4, 3, 9, 5), (2, 2, 4, 2), (3, 3, 3, 3)]:
        for plan in _plans(pp, vp, m, group, forward_only):
            total, all_in_warmup, warmup, remaining = get_pp_rank_microbatches(
                m, vp, group, forward_only=forward_only, p2p_communicator=_Stages(plan.pp_rank, pp, vp)
            )
            assert (total, warmup, remaining) == (m * vp, plan.num_warmup, m * vp - plan.num_warmup)
            assert all_in_warmup == (plan.num_warmup == m * vp)


def test_get_pp_rank_microbatches_without_interleaving():
    # 1F1B: p - r - 1 forward passes before the first backward, capped at m.
    counts = [get_pp_rank_microbatches(3, 1, None, p2p_communicator=_Stages(r, 4, None)) for r in range(4)]
    assert counts == [(3, True, 3, 0), (3, False, 2, 1), (3, False, 1, 2), (3, False, 0, 3)]
    # No pipelining: no warm-up.
    assert get_pp_rank_microbatches(3, 1, None, p2p_communicator=_Stages(0, 1, None)) == (3, False, 0, 3)


def test_overlapped_moe_communication_warms_up_one_more_interleaved_pass():
    plain = get_pp_rank_microbatches(8, 2, 4, p2p_communicator=_Stages(3, 4, 2))
    overlapped = get_pp_rank_microbatches(
        8, 2, 4, overlap_moe_expert_parallel_comm=True, p2p_communicator=_Stages(3, 4, 2)
    )
    assert plain == (16, False, 4, 12) and overlapped == (16, False, 5, 11)


VALID = [
    (pp, vp, m, group)
    for pp in (2, 3, 4)
    for vp in (2, 3)
    for m in range(1, 13)
    for group in (None, pp + 1, pp + 3)
    if pp <= (group or pp) <= m and not 0 < m % (group or pp) < pp
]


@pytest.mark.parametrize("pp,vp,m,group", VALID)
def test_every_pass_runs_once_forward_before_backward(pp, vp, m, group):
    for plan in _plans(pp, vp, m, group):
        order = plan.order()
        forwards = [(mb, c) for kind, mb, c in order if kind == "F"]
        backwards = [(mb, c) for kind, mb, c in order if kind == "B"]
        assert forwards == get_schedule_table(m, vp, group or pp)
        assert backwards == [(mb, vp - 1 - c) for mb, c in get_schedule_table(m, vp, group or pp)]
        for key in forwards:
            assert order.index(("F", *key)) < order.index(("B", *key))


def _program(plan, overlap: bool):
    """The runner's sequence of actions on one rank, as in ``_InterleavedRunner.run``.

    Actions: ``("post", call)`` / ``("wait", call)`` where a call lists its operations in posting order as
    ``(op, peer_offset, message)`` (op is "send" or "recv", peer_offset +1 = next rank, -1 = previous rank), and
    ``("F" | "B", key)`` for a pass that consumes a received tensor (key None when it needs none).
    """
    pp, rank = plan.pp_size, plan.pp_rank
    actions = []

    def call(send_next=None, recv_prev=None, send_prev=None, recv_next=None):
        ops = []
        if send_next is not None:
            mb, chunk = send_next  # the next rank runs the same chunk, or rank 0 the next chunk after the wrap
            ops.append(("send", +1, ("A", (mb, chunk + 1) if rank == pp - 1 else (mb, chunk))))
        if recv_prev is not None:
            ops.append(("recv", -1, ("A", recv_prev)))
        if send_prev is not None:
            mb, chunk = send_prev
            ops.append(("send", -1, ("G", (mb, chunk - 1) if rank == 0 else (mb, chunk))))
        if recv_next is not None:
            ops.append(("recv", +1, ("G", recv_next)))
        return ops

    if not plan.is_first_virtual_stage(plan.forward_key(0)[1]):
        first = call(recv_prev=plan.forward_key(0))
        actions += [("post", first), ("wait", first)]
    pending_a = pending_g = None
    for slot in range(plan.num_slots):
        if pending_a is not None:
            actions.append(("wait", pending_a))
            pending_a = None
        activation = gradient = None
        if plan.has_forward(slot):
            mb, chunk = plan.forward_key(slot)
            actions.append(("F", None if plan.is_first_virtual_stage(chunk) else (mb, chunk)))
            activation = None if plan.is_last_virtual_stage(chunk) else (mb, chunk)
        if overlap:
            pending_a = call(send_next=activation, recv_prev=plan.activation_to_receive(slot))
            actions.append(("post", pending_a))
        if pending_g is not None:
            actions.append(("wait", pending_g))
            pending_g = None
        if plan.has_backward(slot):
            mb, chunk = plan.backward_key(slot - plan.num_warmup)
            actions.append(("B", None if plan.is_last_virtual_stage(chunk) else (mb, chunk)))
            gradient = None if plan.is_first_virtual_stage(chunk) else (mb, chunk)
        if overlap:
            pending_g = call(send_prev=gradient, recv_next=plan.gradient_to_receive(slot))
            actions.append(("post", pending_g))
        else:
            both = call(activation, plan.activation_to_receive(slot), gradient, plan.gradient_to_receive(slot))
            actions += [("post", both), ("wait", both)]
    for pending in (pending_a, pending_g):
        if pending is not None:
            actions.append(("wait", pending))
    return actions


def _simulate(plans, overlap: bool) -> None:
    """Run every rank's program with rendezvous semantics: an operation completes once its counterpart is posted.

    Messages between two ranks in one direction are matched first-in first-out (as on gloo and NCCL), whatever they
    carry; a matched pair must carry the same message. Fails on a mismatch, on a tensor used before it arrived, and
    on a deadlock (no rank can move).
    """
    pp = len(plans)
    programs = [_program(plan, overlap) for plan in plans]
    position = [0] * pp
    channels = {}  # (src, dst) -> {"send": [message], "recv": [message]}
    posted = {}  # id(op list) + op index -> (channel, side, index)
    arrived = [set() for _ in range(pp)]

    def complete(rank, ops):
        done = True
        for index, (op, offset, message) in enumerate(ops):
            peer = (rank + offset) % pp
            channel = (rank, peer) if op == "send" else (peer, rank)
            side, other = ("send", "recv") if op == "send" else ("recv", "send")
            position_in_channel = posted[(id(ops), index)]
            queue = channels[channel][other]
            if position_in_channel >= len(queue):
                done = False
                continue
            met = queue[position_in_channel]
            assert met == message, f"rank {rank}: {op} {message} met {met}"
            if op == "recv":
                arrived[rank].add(message)
        return done

    while any(position[r] < len(programs[r]) for r in range(pp)):
        moved = False
        for rank in range(pp):
            while position[rank] < len(programs[rank]):
                kind, payload = programs[rank][position[rank]]
                if kind == "post":
                    for index, (op, offset, message) in enumerate(payload):
                        peer = (rank + offset) % pp
                        channel = (rank, peer) if op == "send" else (peer, rank)
                        queues = channels.setdefault(channel, {"send": [], "recv": []})
                        posted[(id(payload), index)] = len(queues[op])
                        queues[op].append(message)
                elif kind == "wait":
                    if not complete(rank, payload):
                        break
                elif payload is not None:
                    needed = ("A" if kind == "F" else "G", payload)
                    assert needed in arrived[rank], f"rank {rank} runs {kind}{payload} before it arrived"
                position[rank] += 1
                moved = True
        assert moved, f"deadlock: ranks stopped at actions {position} of {[len(p) for p in programs]}"
    for (src, dst), queues in channels.items():
        assert len(queues["send"]) == len(queues["recv"]), f"unmatched messages from rank {src} to rank {dst}"


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("pp,vp,m,group", VALID)
def test_simulated_ring_neither_mismatches_nor_deadlocks(pp, vp, m, group, forward_only, overlap):
    _simulate(_plans(pp, vp, m, group, forward_only), overlap)


def test_simulation_catches_a_wrong_plan():
    plans = _plans(2, 2, 4)
    original = plans[1].gradient_to_receive
    plans[1].gradient_to_receive = lambda slot: original(slot + 1)  # ask for each gradient one slot early
    with pytest.raises(AssertionError):
        _simulate(plans, overlap=False)


PLAN_ERRORS = [
    (dict(pp=1, vp=2, m=4), r"needs pipeline_model_parallel_size > 1 \(got 1\)"),
    (dict(pp=2, vp=None, m=4), "needs virtual_pipeline_model_parallel_size to be set"),
    (dict(pp=2, vp=3, m=4, chunks=2), "got 2 model chunks but virtual_pipeline_model_parallel_size is 3"),
    (
        dict(pp=4, vp=2, m=2),
        r"microbatch_group_size_per_vp_stage \(4\) must lie between .* \(4\) and num_microbatches \(2\)",
    ),
    (dict(pp=4, vp=2, m=6), r"num_microbatches \(6\) leaves a last group of 2 micro-batches"),
    (dict(pp=2, vp=2, m=7, group=3), r"num_microbatches \(7\) leaves a last group of 1 micro-batches"),
]


@pytest.mark.parametrize("fields,message", PLAN_ERRORS)
def test_plan_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        InterleavedPlan(
            num_microbatches=fields["m"],
            num_model_chunks=fields.get("chunks", fields["vp"] or 2),
            microbatch_group_size=fields.get("group"),
            pp_rank=0,
            pp_size=fields["pp"],
            vp_size=fields["vp"],
        )
