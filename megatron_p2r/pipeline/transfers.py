"""What a rank's p2p link (``p2p.StageLink``) knows from the step's schedule (``order.py``).

- **incoming**: for each neighbour, the messages it sends this rank, in its order (the link
  receives in that order and keeps early arrivals);
- **acknowledges**: which of this rank's sends a message's arrival proves received. gloo
  reports a send's completion only through a blocking ``wait``, so the link reasons instead:
  ranks run their ops in order, so each message carries the ops that happened before it was
  sent (a vector clock, from ``order.causal_order``); when it shows that the receiver of one of
  our sends has run the op that uses it, that send is done, its ``wait`` returns at once and
  its buffer goes. The proof may travel through other ranks (around the ring of interleaved
  stages in evaluation);
- **downstream**: neighbours that never send this rank anything, not even through other ranks
  (evaluation without interleaving: the messages form a chain). Nothing proves our sends to
  them arrived, but waiting for them cannot wait on this rank, so the link keeps one send to
  such a peer in flight and waits for it before the next.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, List, NamedTuple, Sequence, Tuple

from megatron_p2r.pipeline.order import Message, Op, causal_order, input_of, sent_by


class Transfers(NamedTuple):
    incoming: Dict[int, List[Message]]  # neighbour -> the messages it sends here, in its order
    acknowledges: Dict[Message, List[Message]]  # an arriving message -> this rank's sends it proves received
    downstream: FrozenSet[int]  # neighbours sent to that never send here, even through others


def _send_clocks(
    all_ops: Sequence[Sequence[Op]], pp: int, chunks: int, watched: Sequence[int]
) -> Dict[Message, Tuple[int, ...]]:
    """For every message: per rank in ``watched``, the index of its last op that happened
    before the send (a vector clock; each entry propagates on its own, so only those kept)."""
    slot = {q: j for j, q in enumerate(watched)}
    clock = [[-1] * len(watched) for _ in range(pp)]
    stamps: Dict[Message, Tuple[int, ...]] = {}
    for r, i in causal_order(all_ops, pp, chunks):
        op = all_ops[r][i]
        wanted = input_of(op, pp, chunks, r)
        if wanted is not None:
            clock[r] = list(map(max, clock[r], stamps[wanted[0]]))
        if r in slot:
            clock[r][slot[r]] = i
        for _, msg in sent_by(op, pp, chunks, r):
            stamps[msg] = tuple(clock[r])
    return stamps


def pulls(
    ops: Sequence[Op], pp: int, chunks: int, rank: int, incoming: Dict[int, List[Message]]
) -> List[List[Message]]:
    """For each op of ``rank``, the messages its link takes off the wire during it: the
    sender's messages in order, up to the one the op needs (earlier ones are kept)."""
    queues = {q: list(reversed(msgs)) for q, msgs in incoming.items()}
    early: set = set()
    out = []
    for op in ops:
        wanted, taken = input_of(op, pp, chunks, rank), []
        if wanted is not None and wanted[0] in early:
            early.remove(wanted[0])
        elif wanted is not None:
            while not taken or taken[-1] != wanted[0]:
                taken.append(queues[wanted[1]].pop())
            early.update(taken[:-1])
        out.append(taken)
    return out


def _reaches(edges: Dict[int, set], start: int) -> set:
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


class _Step(NamedTuple):
    """What every rank's link knowledge derives from: computed once when all ranks' are wanted."""

    sent: List[List[Tuple[int, int, Message]]]  # per rank: (op index, destination, message)
    stamps: Dict[Message, Tuple[int, ...]]  # per message: clock entries of ``watched``
    watched: Dict[int, int]  # rank -> its entry in the clocks
    edges: Dict[int, set]  # rank -> the ranks it sends to


def _sent(all_ops: Sequence[Sequence[Op]], pp: int, chunks: int) -> List[List[Tuple[int, int, Message]]]:
    return [
        [(i, dst, msg) for i, op in enumerate(ops) for dst, msg in sent_by(op, pp, chunks, q)]
        for q, ops in enumerate(all_ops)
    ]


def _step(all_ops: Sequence[Sequence[Op]], pp: int, chunks: int, sent, watched: Sequence[int]) -> _Step:
    edges: Dict[int, set] = {}
    for q in range(pp):
        edges.setdefault(q, set()).update(dst for _, dst, _ in sent[q])
    return _Step(sent, _send_clocks(all_ops, pp, chunks, watched), {q: j for j, q in enumerate(watched)}, edges)


def transfers(all_ops: Sequence[Sequence[Op]], pp: int, chunks: int, rank: int) -> Transfers:
    """The link's knowledge for ``rank`` (``all_ops[q]`` is rank q's order)."""
    sent = _sent(all_ops, pp, chunks)
    destinations = sorted({dst for _, dst, _ in sent[rank]})  # the clock entries this rank needs
    return _transfers(all_ops, pp, chunks, rank, _step(all_ops, pp, chunks, sent, destinations))


def _transfers(all_ops: Sequence[Sequence[Op]], pp: int, chunks: int, rank: int, step: _Step) -> Transfers:
    sent = step.sent
    neighbours = sorted({(rank - 1) % pp, (rank + 1) % pp} - {rank})
    incoming = {q: [msg for _, dst, msg in sent[q] if dst == rank] for q in neighbours}
    # this rank's sends to each destination, ordered by the index of the receiver's op that uses them
    unproven: Dict[int, List[Tuple[int, Message]]] = {}
    for dst in sorted({dst for _, dst, _ in sent[rank]}):
        position = {op: i for i, op in enumerate(all_ops[dst])}
        unproven[dst] = sorted(
            ((position[Op(msg.kind, msg.microbatch, msg.stage // pp)], msg) for _, to, msg in sent[rank] if to == dst),
            reverse=True,
        )
    acknowledges: Dict[Message, List[Message]] = {}
    for arrived in (msg for taken in pulls(all_ops[rank], pp, chunks, rank, incoming) for msg in taken):
        proven = []
        for dst in sorted(unproven):
            ran_up_to = step.stamps[arrived][step.watched[dst]]
            while unproven[dst] and unproven[dst][-1][0] <= ran_up_to:
                proven.append(unproven[dst].pop()[1])
        if proven:
            acknowledges[arrived] = proven
    downstream = frozenset(q for q in step.edges[rank] if rank not in _reaches(step.edges, q))
    return Transfers(incoming, acknowledges, downstream)


def link_buffers(
    all_ops: Sequence[Sequence[Op]], pp: int, chunks: int, rank: int, posted_ahead: bool = False
) -> List[int]:
    """Transfer buffers the link of ``rank`` holds while each of its ops runs: its sends not yet
    known received, messages that arrived before they were needed and, with ``posted_ahead``
    (--overlap-p2p-communication), the next op's receives, posted before this op computes."""
    return _buffers(all_ops, pp, chunks, rank, transfers(all_ops, pp, chunks, rank), posted_ahead)


def every_link_buffers(
    all_ops: Sequence[Sequence[Op]], pp: int, chunks: int, posted_ahead: bool = False
) -> List[List[int]]:
    """``link_buffers`` of every rank, walking the step's causal order once for all of them
    (full vector clocks) instead of once per rank: the planner asks for every stage, and
    per rank the walk costs as much as the whole step (P x 2m ops)."""
    sent = _sent(all_ops, pp, chunks)
    step = _step(all_ops, pp, chunks, sent, range(pp))
    return [_buffers(all_ops, pp, chunks, r, _transfers(all_ops, pp, chunks, r, step), posted_ahead) for r in range(pp)]


def _buffers(
    all_ops: Sequence[Sequence[Op]], pp: int, chunks: int, rank: int, t: Transfers, posted_ahead: bool
) -> List[int]:
    pending: Dict[Message, int] = {}  # send -> its destination
    early: set = set()
    out = []
    taken_by = pulls(all_ops[rank], pp, chunks, rank, t.incoming)
    ahead = [len(taken) if posted_ahead else 0 for taken in taken_by[1:]] + [0]
    for op, taken, posted in zip(all_ops[rank], taken_by, ahead, strict=True):
        wanted = input_of(op, pp, chunks, rank)
        early.update(taken)
        early.discard(wanted[0] if wanted is not None else None)
        for msg in taken:
            for done in t.acknowledges.get(msg, ()):
                pending.pop(done)
        out.append(len(pending) + len(early) + posted)
        for dst, msg in sent_by(op, pp, chunks, rank):
            if dst in t.downstream:
                pending = {m: d for m, d in pending.items() if d != dst}
            pending[msg] = dst
    return out
