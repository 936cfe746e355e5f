"""The order of forwards and backwards on each rank (``pipeline/order.py``), without processes:
Megatron-LM's interleaved table, no deadlock for any m, the bubble, in-flight counts, and the
p2p bookkeeping derived from it."""

from __future__ import annotations

import pytest

from megatron_p2r.pipeline.order import (
    BACKWARD,
    FORWARD,
    Message,
    Op,
    forward_table,
    max_outstanding,
    pipeline_ops,
    simulate,
    step_slots,
    warmup_forwards,
)
from megatron_p2r.pipeline.transfers import link_buffers, transfers

GRID = [(pp, v, m) for pp in (2, 3, 4, 8) for v in (1, 2, 3) for m in range(1, 3 * pp + 2)]


def test_interleaved_table_follows_megatron():
    """Groups of P micro-batches, chunk by chunk (Megatron's get_schedule_table with
    microbatch_group_size_per_vp_stage = P); m mod P joins the last group."""
    assert forward_table(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert forward_table(5, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (4, 0), (2, 1), (3, 1), (4, 1)]
    # Megatron's warm-up: 2(P-p-1) + (v-1)P on rank p, for m a multiple of P
    assert [warmup_forwards("1f1b", 4, 2, 8, p) for p in range(4)] == [10, 8, 6, 4]
    ops = pipeline_ops("1f1b", 2, 2, 4, rank=1)
    assert ops[:4] == [Op(FORWARD, 0, 0), Op(FORWARD, 1, 0), Op(FORWARD, 0, 1), Op(BACKWARD, 0, 1)]


@pytest.mark.parametrize("pp,v,m", GRID)
def test_every_schedule_runs_each_op_once_and_never_deadlocks(pp, v, m):
    for schedule in ("1f1b",) + (("gpipe",) if v == 1 else ()):
        timeline = simulate(schedule, pp, v, m)  # raises on a deadlock
        for rank in timeline:
            ops = [op for op, _, _ in rank]
            assert sorted(ops) == sorted(Op(k, mb, c) for k in (FORWARD, BACKWARD) for mb in range(m) for c in range(v))
            for c in range(v):  # each chunk back-propagates its micro-batches in order
                assert [op.microbatch for op in ops if op.kind == BACKWARD and op.chunk == c] == list(range(m))


def test_bubble_is_p_minus_1_over_v_micro_batches():
    """Uniform stages, free transfers: a step lasts m + (P-1)/v micro-batch slots for every
    m >= P (Megatron's (P-1)/(v m) bubble, here also for m not a multiple of P); 1F1B and GPipe
    m + P - 1; with m < P the interleaved schedule cannot fill the pipeline."""
    for pp, v, m in GRID:
        if v == 1:
            assert step_slots("1f1b", pp, 1, m) == pytest.approx(m + pp - 1)
            assert step_slots("gpipe", pp, 1, m) == pytest.approx(m + pp - 1)
        elif m >= pp:
            assert step_slots("1f1b", pp, v, m) == pytest.approx(m + (pp - 1) / v), (pp, v, m)
        else:
            assert m + (pp - 1) / v < step_slots("1f1b", pp, v, m) <= m + pp - 1 + 1e-9


def test_in_flight_forwards():
    """1F1B holds min(P-p, m) micro-batches on rank p, GPipe m; interleaving holds more chunk
    forwards: warm-up + 1, each 1/v of the stage's layers."""
    for p in range(4):
        assert max_outstanding(pipeline_ops("1f1b", 4, 1, 6, p)) == 4 - p
        assert max_outstanding(pipeline_ops("1f1b", 4, 1, 2, p)) == min(4 - p, 2)
        assert max_outstanding(pipeline_ops("gpipe", 4, 1, 6, p)) == 6
        assert max_outstanding(pipeline_ops("1f1b", 4, 2, 8, p)) == warmup_forwards("1f1b", 4, 2, 8, p) + 1
    assert max_outstanding(pipeline_ops("1f1b", 4, 2, 8, 0), weight=lambda chunk: 0.5) == 5.5


def test_receives_follow_each_senders_order_and_sends_are_acknowledged():
    """With interleaving on P=2 and m=5 rank 0 consumes rank 1's activations and gradients (one
    direction, one stream) in another order than rank 1 sends them (why p2p receives in the
    sender's order and keeps early arrivals; with m a multiple of P the orders agree);
    every send is acknowledged at most once, and only by a message its receiver sent after
    using it (or from the op that used it: an op sends after it has received)."""
    pp, v, m = 2, 2, 5
    all_ops = [pipeline_ops("1f1b", pp, v, m, r) for r in range(pp)]
    reordered = False
    for rank in range(pp):
        t = transfers(all_ops, pp, v, rank)
        consumed = [Message(op.kind, op.microbatch, op.chunk * pp + rank) for op in all_ops[rank]]
        for peer, msgs in t.incoming.items():
            in_use_order = [msg for msg in consumed if msg in set(msgs)]
            assert sorted(in_use_order) == sorted(msgs)
            reordered |= in_use_order != msgs
        acked = [msg for msgs in t.acknowledges.values() for msg in msgs]
        assert len(acked) == len(set(acked))
        peer_ops = all_ops[1 - rank]
        for arrival, msgs in t.acknowledges.items():
            sent_at = next(i for i, op in enumerate(peer_ops) if _sends(op, pp, 1 - rank, arrival))
            for msg in msgs:
                assert peer_ops.index(Op(msg.kind, msg.microbatch, msg.stage // pp)) <= sent_at
    assert reordered


def _sends(op: Op, pp: int, rank: int, msg: Message) -> bool:
    """Whether ``op`` of ``rank`` sends ``msg``."""
    step = 1 if op.kind == FORWARD else -1
    return (op.kind, op.microbatch, op.chunk * pp + rank + step) == tuple(msg)


@pytest.mark.parametrize("posted_ahead", [False, True])
@pytest.mark.parametrize("forward_only", [False, True])
def test_link_buffers_are_bounded_by_the_schedule(forward_only, posted_ahead):
    """What p2p holds (sends not yet known received, early arrivals, receives posted ahead)
    does not grow with m, in training and in evaluation (forward only: without interleaving
    nothing comes back, so sends downstream go one at a time; with it the proof comes around
    the ring of stages)."""
    for pp, v in ((2, 1), (4, 1), (2, 2), (4, 2)):
        peaks = []
        for m in (2 * pp, 4 * pp, 8 * pp):
            all_ops = [pipeline_ops("1f1b", pp, v, m, r, forward_only) for r in range(pp)]
            peaks.append([max(link_buffers(all_ops, pp, v, r, posted_ahead)) for r in range(pp)])
        assert peaks[0] == peaks[1] == peaks[2], (pp, v, peaks)
        assert max(peaks[0]) <= 2 * pp + posted_ahead, (pp, v, peaks)


def test_receives_posted_ahead_are_held_one_op_longer():
    """With --overlap-p2p-communication every message a rank receives, but those of its first
    op, is held during one more op (the one before the op that uses it, while it travels)."""
    for pp, v, m in ((2, 2, 5), (4, 2, 8), (4, 1, 6)):
        all_ops = [pipeline_ops("1f1b", pp, v, m, r) for r in range(pp)]
        for r in range(pp):
            serial, ahead = link_buffers(all_ops, pp, v, r), link_buffers(all_ops, pp, v, r, posted_ahead=True)
            received = sum(len(msgs) for msgs in transfers(all_ops, pp, v, r).incoming.values())
            first_op_takes = 1 if r > 0 else 0  # rank 0's first op reads tokens, the others' an activation
            assert all(a >= s for a, s in zip(ahead, serial, strict=True)) and ahead[-1] == serial[-1], (pp, v, r)
            assert sum(ahead) - sum(serial) == received - first_op_takes, (pp, v, r)


def test_evaluation_without_interleaving_waits_downstream_only():
    all_ops = [pipeline_ops("1f1b", 4, 1, 8, r, forward_only=True) for r in range(4)]
    assert [transfers(all_ops, 4, 1, r).downstream for r in range(4)] == [{1}, {2}, {3}, set()]
    ring = [pipeline_ops("1f1b", 4, 2, 8, r, forward_only=True) for r in range(4)]
    assert all(not transfers(ring, 4, 2, r).downstream and transfers(ring, 4, 2, r).acknowledges for r in range(4))
    training = [pipeline_ops("1f1b", 4, 1, 8, r) for r in range(4)]
    assert all(not transfers(training, 4, 1, r).downstream for r in range(4))
