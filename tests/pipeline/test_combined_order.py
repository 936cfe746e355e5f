"""The combined 1F1B order of --overlap-moe-expert-parallel-comm (``pipeline/order.py``:
``combined_ticks``), without processes: every op once, each chunk's forwards and backwards in
micro-batch order, each step's inputs sent at an earlier tick by the neighbours (the one-step
lag that keeps the stages from serializing), no deadlock, the in-flight count per stage, the
bubble, and P = 1 being the one-stage overlap; with interleaving (v chunks per rank) too."""

from __future__ import annotations

import pytest

from megatron_p2r.pipeline.order import (
    BACKWARD,
    FORWARD,
    Op,
    causal_order,
    combined_ops,
    combined_step_slots,
    combined_steps,
    combined_ticks,
    combined_warmup,
    input_of,
    max_outstanding,
    sent_by,
    step_ops,
    step_slots,
)
from megatron_p2r.pipeline.transfers import link_buffers

GRID = [(pp, v, m) for pp in (1, 2, 3, 4, 8) for v in ((1,) if pp == 1 else (1, 2, 3)) for m in range(1, 3 * pp + 3)]


@pytest.mark.parametrize("pp,v,m", GRID)
def test_every_op_once_in_microbatch_order(pp, v, m):
    for r in range(pp):
        ops = combined_ops(pp, v, m, r)
        for c in range(v):
            assert [op.microbatch for op in ops if op.kind == FORWARD and op.chunk == c] == list(range(m))
            assert [op.microbatch for op in ops if op.kind == BACKWARD and op.chunk == c] == list(range(m))
        assert all(step != (None, None) for step in combined_steps(pp, v, m, r))


@pytest.mark.parametrize("pp,v,m", GRID)
def test_each_step_receives_what_the_neighbours_sent_a_tick_before(pp, v, m):
    """A step's activation and gradient were sent at the end of an earlier tick (so the two
    neighbours' steps run side by side, not one after the other), and a backward's own forward
    ran in an earlier step. Interleaved with fewer micro-batches than stages (which Megatron-LM
    refuses), the chunk boundary from the last rank to the first cannot keep the lag: those
    steps wait a tick, without deadlock."""
    sent_at, forward_at, late = {}, {}, 0
    for tick, r, step in sorted((t, r, s) for r in range(pp) for t, s in combined_ticks(pp, v, m, r)):
        for op in step_ops(step):
            wanted = input_of(op, pp, v, r)
            late += wanted is not None and not sent_at.get(wanted[0], tick) < tick
            if op.kind == BACKWARD:
                assert forward_at[(r, op.microbatch, op.chunk)] < tick, (pp, v, m, r, step)
        for op in step_ops(step):
            if op.kind == FORWARD:
                forward_at[(r, op.microbatch, op.chunk)] = tick
            for _, msg in sent_by(op, pp, v, r):
                sent_at[msg] = tick
    assert late == 0 or (v > 1 and m < pp), (pp, v, m, late)
    causal_order([combined_ops(pp, v, m, r) for r in range(pp)], pp, v)  # and p2p's own check: no deadlock


def test_warmup_and_in_flight():
    """Rank p warms up with 2(P-p-1) + (v-1)P + 1 chunk forwards and holds that many in flight
    (a step's pair counted once: its forward fills layers as its backward frees them), at most
    every forward: without interleaving 2(P-p)-1 micro-batches where 1F1B holds P-p; steady
    steps pair the t-th forward with the (t - warm-up)-th backward."""
    assert [combined_warmup(4, 1, 16, p) for p in range(4)] == [7, 5, 3, 1]
    assert [combined_warmup(4, 2, 16, p) for p in range(4)] == [11, 9, 7, 5]
    for pp, v, m in GRID:
        for p in range(pp):
            assert max_outstanding(combined_ops(pp, v, m, p)) == combined_warmup(pp, v, m, p), (pp, v, m, p)
    f, b = (lambda mb, c=0: Op(FORWARD, mb, c)), (lambda mb, c=0: Op(BACKWARD, mb, c))
    assert combined_steps(2, 1, 4, 1) == [(f(0), None), (f(1), b(0)), (f(2), b(1)), (f(3), b(2)), (None, b(3))]
    assert combined_steps(2, 1, 4, 0) == [
        (f(0), None),
        (f(1), None),
        (f(2), None),
        (f(3), b(0)),
        (None, b(1)),
        (None, b(2)),
        (None, b(3)),
    ]
    assert combined_steps(2, 2, 2, 1)[:4] == [(f(0), None), (f(1), None), (f(0, 1), None), (f(1, 1), b(0, 1))]


def test_one_stage_is_the_single_stage_overlap():
    """P = 1: F(0), then F(i+1) with B(i), then B(m-1)."""
    assert combined_steps(1, 1, 3, 0) == [
        (Op(FORWARD, 0), None),
        (Op(FORWARD, 1), Op(BACKWARD, 0)),
        (Op(FORWARD, 2), Op(BACKWARD, 1)),
        (None, Op(BACKWARD, 2)),
    ]


def test_bubble_is_that_of_1f1b():
    """Uniform stages, free transfers, a step as long as its forward plus its backward: the
    step lasts as long as under 1F1B (m + P - 1 slots) or interleaved 1F1B (m + (P-1)/v for
    m >= P): the longer warm-up runs inside the same fill."""
    for pp, v, m in GRID:
        assert combined_step_slots(pp, v, m) == pytest.approx(step_slots("1f1b", pp, v, m)), (pp, v, m)


def test_link_buffers_are_bounded():
    for pp, v in ((2, 1), (4, 1), (2, 2), (4, 2)):
        peaks = [
            max(max(link_buffers([combined_ops(pp, v, m, r) for r in range(pp)], pp, v, r)) for r in range(pp))
            for m in (2 * pp, 4 * pp, 8 * pp)
        ]
        assert peaks[0] == peaks[1] == peaks[2] <= 2 * pp, (pp, v, peaks)
