"""The combined 1F1B order of --overlap-moe-expert-parallel-comm under pipeline parallelism
(``pipeline/order.py``: ``combined_ticks``), without processes: every op once, forwards and
backwards in micro-batch order, each step's inputs sent at an earlier tick by the neighbours
(the one-step lag that keeps the stages from serializing), the in-flight count per stage, the
bubble, and P = 1 being the one-stage overlap."""
from __future__ import annotations

import pytest

from megatron_p2r.pipeline.order import (BACKWARD, FORWARD, causal_order, combined_ops, combined_step_slots,
                                         combined_steps, combined_ticks, combined_warmup, input_of,
                                         max_outstanding, sent_by, step_ops)
from megatron_p2r.pipeline.transfers import link_buffers

GRID = [(pp, m) for pp in (1, 2, 3, 4, 8) for m in range(1, 3 * pp + 3)]


@pytest.mark.parametrize("pp,m", GRID)
def test_every_op_once_in_microbatch_order(pp, m):
    for r in range(pp):
        ops = combined_ops(pp, m, r)
        assert [op.microbatch for op in ops if op.kind == FORWARD] == list(range(m))
        assert [op.microbatch for op in ops if op.kind == BACKWARD] == list(range(m))
        assert all(step != (None, None) for step in combined_steps(pp, m, r))


@pytest.mark.parametrize("pp,m", GRID)
def test_each_step_receives_what_the_neighbours_sent_a_tick_before(pp, m):
    """A step's activation and gradient were sent at the end of an earlier tick (so the two
    neighbours' steps run side by side, not one after the other), and a backward's own forward
    ran in an earlier step."""
    sent_at, forward_at = {}, {}
    for tick, r, step in sorted((t, r, s) for r in range(pp) for t, s in combined_ticks(pp, m, r)):
        for op in step_ops(step):
            wanted = input_of(op, pp, 1, r)
            if wanted is not None:
                assert sent_at[wanted[0]] < tick, (pp, m, r, step)
            if op.kind == BACKWARD:
                assert forward_at[(r, op.microbatch)] < tick, (pp, m, r, step)
        for op in step_ops(step):
            if op.kind == FORWARD:
                forward_at[(r, op.microbatch)] = tick
            for _, msg in sent_by(op, pp, 1, r):
                sent_at[msg] = tick
    causal_order([combined_ops(pp, m, r) for r in range(pp)], pp, 1)   # and p2p's own check: no deadlock


def test_warmup_and_in_flight():
    """Rank p warms up with 2(P-p-1)+1 forwards, so it holds min(2(P-p)-1, m) micro-batches in
    flight (1F1B: min(P-p, m); a step's pair counted once: its forward fills layers as its
    backward frees them); steady steps pair F(t) with B(t - warm-up)."""
    assert [combined_warmup(4, 16, p) for p in range(4)] == [7, 5, 3, 1]
    for pp, m in GRID:
        for p in range(pp):
            assert max_outstanding(combined_ops(pp, m, p)) == min(2 * (pp - p) - 1, m), (pp, m, p)
    assert combined_steps(2, 4, 1) == [(0, None), (1, 0), (2, 1), (3, 2), (None, 3)]
    assert combined_steps(2, 4, 0) == [(0, None), (1, None), (2, None), (3, 0), (None, 1), (None, 2), (None, 3)]


def test_one_stage_is_the_single_stage_overlap():
    """P = 1: F(0), then F(i+1) with B(i), then B(m-1): ``a2a_overlap``'s schedule."""
    assert combined_steps(1, 4, 0) == [(0, None), (1, 0), (2, 1), (3, 2), (None, 3)]


def test_bubble_is_that_of_1f1b():
    """Uniform stages, free transfers, a step as long as its forward plus its backward: m + P - 1
    slots, as 1F1B (the longer warm-up runs inside the same fill)."""
    for pp, m in GRID:
        assert combined_step_slots(pp, m) == pytest.approx(m + pp - 1), (pp, m)


def test_link_buffers_are_bounded():
    for pp in (2, 4):
        peaks = [max(max(link_buffers([combined_ops(pp, m, r) for r in range(pp)], pp, 1, r)) for r in range(pp))
                 for m in (2 * pp, 4 * pp, 8 * pp)]
        assert peaks[0] == peaks[1] == peaks[2] <= 2 * pp, peaks
