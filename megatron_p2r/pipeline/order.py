"""Which forwards and backwards each pipeline rank runs, in which order.

Pure functions of (schedule, P, v, m, rank): every rank computes its neighbours' order too (the
p2p receives follow it, ``p2p.py``), and the planner, the benchmark and the tests reason about
a schedule without processes. An ``Op`` is the forward or backward of one micro-batch on one
model chunk; chunk c of pipeline rank p is virtual stage c*P + p (v = 1: chunk 0 is the stage).

- ``gpipe``: all forwards, then all backwards;
- ``1f1b`` (PipeDream-flush): P-p-1 warm-up forwards, then one forward and one backward per
  remaining micro-batch, then the outstanding backwards;
- ``1f1b`` with v > 1 chunks: Megatron-LM's interleaved 1F1B. Micro-batches run through the chunks in
  groups of P (Megatron's ``microbatch_group_size_per_vp_stage``, default P): forward order is
  group by group, within a group chunk 0 of each of its micro-batches, then chunk 1, ...; the
  k-th backward takes the k-th entry of that table with the chunk mirrored (v-1-c). Rank p runs
  2(P-p-1) + (v-1)P warm-up forwards, then alternates, then drains.
  Megatron requires m to be a multiple of the group size (its last group must hold at least
  P micro-batches, and it asserts P <= group <= m). Here the remainder m mod P joins the last
  group instead, so any m works (m < P is one group of m), and the warm-up counts the largest
  group instead of P (for m a multiple of P: Megatron's schedule exactly). ``simulate`` checks
  such schedules for deadlocks in the tests, and the bubble it leaves is what the planner reports.

- the combined 1F1B of ``--overlap-moe-expert-parallel-comm`` (Megatron-LM's
  ``combined_1f1b_schedule_for_interleaved_pipelining``): after its warm-up forwards a rank runs
  *steps* that each pair the forward of one (micro-batch, chunk) with the backward of another,
  the two taking turns at their expert all-to-alls (``a2a_pipelined.py``). A step's two inputs
  must come from the neighbours' *previous* steps, or the stages serialize (each waiting for its
  neighbour's whole step): rank p warms up with 2(P-p-1) + (v-1)G + 1 chunk forwards (the
  interleaved warm-up, + 1 as Megatron adds for the combined schedule), step t pairs the t-th
  forward of the interleaved table with the (t - warm-up)-th backward and runs at tick t + p,
  one tick after what it receives (``combined_steps``; for m >= P). Without interleaving rank p
  holds 2(P-p)-1 micro-batches in flight instead of P-p (a step's pair counted once); P = 1 is
  the one-stage overlap, F(i+1) with B(i).

Every schedule back-propagates each chunk's micro-batches in micro-batch order, so a parameter
accumulates its gradient in the same order under all of them.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

FORWARD, BACKWARD = "F", "B"


class Op(NamedTuple):
    kind: str  # FORWARD or BACKWARD
    microbatch: int
    chunk: int = 0


class Message(NamedTuple):
    """One p2p transfer of a step: an activation (FORWARD) or a gradient (BACKWARD) of
    ``microbatch`` for virtual stage ``stage``, the receiver."""

    kind: str
    microbatch: int
    stage: int


def microbatch_groups(microbatches: int, pp: int) -> List[range]:
    """Groups of P consecutive micro-batches; the remainder joins the last group."""
    count = max(1, microbatches // pp)
    return [range(g * pp, (g + 1) * pp) for g in range(count - 1)] + [range((count - 1) * pp, microbatches)]


def forward_table(microbatches: int, pp: int, chunks: int) -> List[Tuple[int, int]]:
    """(micro-batch, chunk) of every forward in the order each rank runs them."""
    return [(mb, c) for group in microbatch_groups(microbatches, pp) for c in range(chunks) for mb in group]


def warmup_forwards(schedule: str, pp: int, chunks: int, microbatches: int, rank: int) -> int:
    """Forwards a rank runs before its first backward."""
    if schedule == "gpipe":
        return microbatches
    if chunks == 1:
        return min(pp - rank - 1, microbatches)
    group = max(len(g) for g in microbatch_groups(microbatches, pp))  # P unless the remainder joined
    return min(2 * (pp - rank - 1) + (chunks - 1) * group, microbatches * chunks)


def pipeline_ops(
    schedule: str, pp: int, chunks: int, microbatches: int, rank: int, forward_only: bool = False
) -> List[Op]:
    """Every op of ``rank`` for one step, in order; ``schedule``: "gpipe" or "1f1b" (``SchedulePlan.order``)."""
    table = forward_table(microbatches, pp, chunks)
    forwards = [Op(FORWARD, mb, c) for mb, c in table]
    if forward_only:
        return forwards
    backwards = [Op(BACKWARD, mb, chunks - 1 - c) for mb, c in table]
    warmup = warmup_forwards(schedule, pp, chunks, microbatches, rank)
    ops = forwards[:warmup]
    for k in range(warmup, len(table)):
        ops += [forwards[k], backwards[k - warmup]]
    return ops + backwards[len(table) - warmup :]


def sent_by(op: Op, pp: int, chunks: int, rank: int) -> List[Tuple[int, Message]]:
    """(destination pipeline rank, message) of what ``op`` of ``rank`` sends."""
    stage = op.chunk * pp + rank
    if op.kind == FORWARD and stage < pp * chunks - 1:
        return [((stage + 1) % pp, Message(FORWARD, op.microbatch, stage + 1))]
    if op.kind == BACKWARD and stage > 0:
        return [((stage - 1) % pp, Message(BACKWARD, op.microbatch, stage - 1))]
    return []


def input_of(op: Op, pp: int, chunks: int, rank: int) -> Optional[Tuple[Message, int]]:
    """(message, sender's pipeline rank) ``op`` waits for, or None (first or last virtual stage)."""
    stage = op.chunk * pp + rank
    if op.kind == FORWARD and stage > 0:
        return Message(FORWARD, op.microbatch, stage), (stage - 1) % pp
    if op.kind == BACKWARD and stage < pp * chunks - 1:
        return Message(BACKWARD, op.microbatch, stage), (stage + 1) % pp
    return None


def causal_order(all_ops: Sequence[Sequence[Op]], pp: int, chunks: int) -> List[Tuple[int, int]]:
    """(rank, op index) of every op, each after the rank's earlier ops and after the op that
    sends its input (a backward also after the rank's own forward of it). Raises RuntimeError
    naming the ranks that would wait forever when the schedule deadlocks."""
    done = [0] * pp
    ran: List[set] = [set() for _ in range(pp)]
    sent: set = set()
    order: List[Tuple[int, int]] = []
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while done[r] < len(all_ops[r]):
                op = all_ops[r][done[r]]
                wanted = input_of(op, pp, chunks, r)
                if (op.kind == BACKWARD and Op(FORWARD, op.microbatch, op.chunk) not in ran[r]) or (
                    wanted is not None and wanted[0] not in sent
                ):
                    break
                order.append((r, done[r]))
                ran[r].add(op)
                sent.update(msg for _, msg in sent_by(op, pp, chunks, r))
                done[r] += 1
                progressed = True
    stuck = [r for r in range(pp) if done[r] < len(all_ops[r])]
    if stuck:
        raise RuntimeError(
            f"the schedule with P={pp}, v={chunks} deadlocks: ranks {stuck} wait at ops "
            f"{[all_ops[r][done[r]] for r in stuck]}"
        )
    return order


def max_outstanding(
    ops: Sequence[Op], weight: Callable[[int], float] = lambda chunk: 1, extra: Optional[Sequence[float]] = None
) -> float:
    """The most forwards awaiting their backward at once, each counted ``weight(chunk)``, plus
    ``extra[i]`` while op i runs."""
    held = peak = 0
    for i, op in enumerate(ops):
        if op.kind == FORWARD:
            held += weight(op.chunk)
        peak = max(peak, held + (extra[i] if extra is not None else 0))
        if op.kind == BACKWARD:
            held -= weight(op.chunk)
    return peak


def simulate(
    schedule: str, pp: int, chunks: int, microbatches: int, forward_time: float = 1.0, backward_time: float = 2.0
) -> List[List[Tuple[Op, float, float]]]:
    """(op, start, end) of every op of every rank when each op waits only for its input
    (transfers take no time) and a chunk's forward takes ``forward_time / chunks``.
    Raises RuntimeError when the schedule deadlocks (``causal_order``)."""
    all_ops = [pipeline_ops(schedule, pp, chunks, microbatches, r) for r in range(pp)]
    ready: Dict[Message, float] = {}
    done: List[List[Tuple[Op, float, float]]] = [[] for _ in range(pp)]
    for r, i in causal_order(all_ops, pp, chunks):
        op = all_ops[r][i]
        wanted = input_of(op, pp, chunks, r)
        start = max(done[r][-1][2] if done[r] else 0.0, ready[wanted[0]] if wanted else 0.0)
        end = start + (forward_time if op.kind == FORWARD else backward_time) / chunks
        done[r].append((op, start, end))
        for _, msg in sent_by(op, pp, chunks, r):
            ready[msg] = end
    return done


def combined_warmup(pp: int, chunks: int, microbatches: int, rank: int) -> int:
    """Chunk forwards ``rank`` runs alone before its first combined step: Megatron-LM's
    interleaved warm-up 2(P-p-1) + (v-1)G (G: the largest micro-batch group, ``warmup_forwards``),
    + 1 for the combined schedule; at most every forward of the step."""
    return min(_combined_warmup_uncapped(pp, chunks, microbatches, rank), microbatches * chunks)


def _combined_warmup_uncapped(pp: int, chunks: int, microbatches: int, rank: int) -> int:
    """``combined_warmup`` before its cap: with fewer forwards, the ticks the steps keep."""
    group = max(len(g) for g in microbatch_groups(microbatches, pp))
    return 2 * (pp - rank - 1) + (chunks - 1) * group + 1


# One step of the combined schedule: (its forward, its backward), either may be None.
Step = Tuple[Optional[Op], Optional[Op]]


def combined_ticks(pp: int, chunks: int, microbatches: int, rank: int) -> List[Tuple[int, Step]]:
    """(tick, step) of the combined 1F1B steps of ``rank``: step t runs the t-th forward of
    ``forward_table`` with the (t - warm-up)-th backward (the table's entry, chunk mirrored) at
    tick t + rank; empty ticks (m below the warm-up) are left out."""
    table = forward_table(microbatches, pp, chunks)
    warmup = _combined_warmup_uncapped(pp, chunks, microbatches, rank)
    steps = []
    for t in range(len(table) + warmup):
        forward = Op(FORWARD, *table[t]) if t < len(table) else None
        k = t - warmup
        backward = Op(BACKWARD, table[k][0], chunks - 1 - table[k][1]) if 0 <= k < len(table) else None
        if forward is not None or backward is not None:
            steps.append((t + rank, (forward, backward)))
    return steps


def combined_steps(pp: int, chunks: int, microbatches: int, rank: int) -> List[Step]:
    """The combined 1F1B steps of ``rank``, in order (``combined_ticks``)."""
    return [step for _, step in combined_ticks(pp, chunks, microbatches, rank)]


def step_ops(step: Step) -> List[Op]:
    """A combined step as ops, in the order its receives and sends are issued: the backward
    first, so that counting the forwards awaiting their backward (``max_outstanding``) counts a
    step's pair once (its forward fills layers from the first while its backward frees them from
    the last)."""
    forward, backward = step
    return [op for op in (backward, forward) if op is not None]


def combined_ops(pp: int, chunks: int, microbatches: int, rank: int) -> List[Op]:
    """``rank``'s combined steps as one op order (what its p2p link and the planner read)."""
    return [op for step in combined_steps(pp, chunks, microbatches, rank) for op in step_ops(step)]


def simulate_combined(
    pp: int, chunks: int, microbatches: int, forward_time: float = 1.0, backward_time: float = 2.0
) -> List[List[Tuple[Step, float, float]]]:
    """(step, start, end) of every combined step of every rank, each starting once its rank's
    previous step ended and its inputs were sent (at the end of the neighbours' steps), and
    lasting its forward plus its backward (the all-to-alls hide, the compute does not; a chunk's
    forward takes ``forward_time / chunks``). Raises RuntimeError when the steps deadlock."""
    steps = [combined_steps(pp, chunks, microbatches, r) for r in range(pp)]
    ready: Dict[Message, float] = {}
    done: List[List[Tuple[Step, float, float]]] = [[] for _ in range(pp)]
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while len(done[r]) < len(steps[r]):
                ops = step_ops(steps[r][len(done[r])])
                wanted = [w[0] for w in (input_of(op, pp, chunks, r) for op in ops) if w is not None]
                if any(w not in ready for w in wanted):
                    break
                start = max([done[r][-1][2] if done[r] else 0.0] + [ready[w] for w in wanted])
                end = start + sum(forward_time if op.kind == FORWARD else backward_time for op in ops) / chunks
                done[r].append((steps[r][len(done[r])], start, end))
                for op in ops:
                    for _, msg in sent_by(op, pp, chunks, r):
                        ready[msg] = end
                progressed = True
    stuck = [r for r in range(pp) if len(done[r]) < len(steps[r])]
    if stuck:
        raise RuntimeError(f"the combined schedule with P={pp}, v={chunks} deadlocks: ranks {stuck} wait")
    return done


@functools.lru_cache(maxsize=8)
def combined_step_slots(pp: int, chunks: int, microbatches: int) -> float:
    """``step_slots`` of the combined 1F1B schedule: with uniform stages a step lasts as long as
    1F1B's, m + P - 1 slots (the longer warm-up fills the same pipeline; interleaved, m + (P-1)/v
    for m >= P)."""
    timeline = simulate_combined(pp, chunks, microbatches, 1.0 / 3, 2.0 / 3)
    return max(end for rank in timeline for _, _, end in rank)


@functools.lru_cache(maxsize=8)  # the planner's phases share it; P=64 x m=512 walks 65,536 ops
def step_slots(schedule: str, pp: int, chunks: int, microbatches: int) -> float:
    """A step's time in units of one micro-batch's forward + backward on one rank (uniform
    stages, backward = 2 x forward, free transfers): m + P - 1 for GPipe and 1F1B,
    m + (P-1)/v for interleaved 1F1B with m a multiple of P. The bubble is this minus m."""
    timeline = simulate(schedule, pp, chunks, microbatches, 1.0 / 3, 2.0 / 3)
    return max(end for rank in timeline for _, _, end in rank)
