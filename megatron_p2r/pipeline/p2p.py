"""Point-to-point transfers between pipeline ranks for one step.

Every transfer is one message: the tensor. Both ends know its shape and dtype beforehand —
every stage holds all micro-batches of the step, and a stage's hidden states for a micro-batch
of token shape (b, s) are ``model.hidden_spec((b, s))`` — so the receiver allocates from that
``spec`` and no shape header travels (Megatron-LM does the same from its config, but needs
``--variable-seq-lengths`` and an extra shape exchange when shapes vary; here micro-batches of
different shapes in one step cost nothing extra). The sender checks its tensor against the
same spec, so a stage that produced something else fails loudly instead of sending bytes the
peer would misread.

Messages are named (``order.Message``: activation or gradient, micro-batch, receiving virtual
stage), and each rank knows, for each neighbour, the order in which that neighbour sends it
messages (``transfers.py``: every rank computes every rank's schedule). A receive takes the
neighbour's messages in exactly that order and keeps any that arrive before they are needed.
So the receiver never depends on how a backend matches messages (NCCL matches in issue order
and has no tags): with interleaving on P = 2 the activations and gradients between the two
ranks share one direction, in an order the receiver's schedule does not always follow.
Receiving an earlier message first never waits longer than the wanted one, sent after it.

Sends are non-blocking (``isend``) and a sent buffer is released as soon as the send is known
to be complete. gloo tells that only through a blocking ``wait()`` (``is_completed`` stays
False until then), so the link uses the schedule: an arriving message that the sender sent
after (transitively) the receiver of one of our sends used it proves that send arrived
(``transfers.py``), and that send's ``wait()`` returns at once and its buffer goes; sends to a
neighbour that never sends back (evaluation without interleaving) are waited for one at a
time. ``wait()`` completes the rest at the end of the step. Receives block, unless posted
ahead (``post``, ``--overlap-p2p-communication``): the schedule posts the next op's receives
(``irecv``, in the sender's order) before it computes the current op, so they travel while it
computes, and ``recv`` waits on them where it would have received them. With sends that never
wait on a rank that waits on them and receives in the sender's order, waited on where the
schedule needs them, a schedule that is deadlock-free on its data dependencies
(``order.causal_order``) is deadlock-free here, posted ahead or not, which is why no call pairs
a send with a receive in one batched operation (``batch_isend_irecv`` has hung on gloo). Peers are pipeline ranks with this rank's tp and dp coordinates (``ps.peer``).
Works with gloo (CPU tensors) and NCCL (device tensors).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, Iterator, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.order import FORWARD, Message
from megatron_p2r.pipeline.transfers import Transfers

# (shape, dtype) of one transfer, known to both ends.
Spec = Tuple[Tuple[int, ...], torch.dtype]


def check_spec(t: torch.Tensor, spec: Spec, what: str) -> None:
    shape, dtype = spec
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise RuntimeError(
            f"pipeline p2p: the {what} is {t.dtype} {tuple(t.shape)}, but the peer stage "
            f"allocates {dtype} {tuple(shape)} (model.hidden_spec) to receive it"
        )


def deallocate_output(out: torch.Tensor) -> None:
    """Free the data of a stage output that was sent to the next stage, keeping its autograd
    graph for the backward (Megatron-LM's ``deallocate_output_tensor``): the storage itself is
    released with the send's buffer (``StageLink``)."""
    if out._base is not None:
        raise RuntimeError("pipeline: a stage's output is a view of another tensor; freeing it would free nothing")
    out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


def _what(message: Message) -> str:
    kind = "activation to send forward" if message.kind == FORWARD else "gradient to send backward"
    return f"{kind} (micro-batch {message.microbatch}, virtual stage {message.stage})"


class StageLink:
    """The named transfers of one step between this rank and its pipeline neighbours.

    ``schedule``: what the step's order tells the link (``transfers.transfers``): each
    neighbour's messages in its order, which arrivals prove which sends received, and the
    neighbours that never send back; ``spec_of(message)``: the (shape, dtype) both ends use.
    """

    def __init__(self, ps: ParallelState, schedule: Transfers, spec_of: Callable[[Message], Spec]):
        self.ps, self.spec_of, self.schedule = ps, spec_of, schedule
        self._queues: Dict[int, Iterator[Message]] = {q: iter(msgs) for q, msgs in schedule.incoming.items()}
        self._early: Dict[Message, torch.Tensor] = {}
        self._pending: Dict[Message, Tuple[dist.Work, torch.Tensor, int]] = {}
        # per neighbour: receives posted ahead, in its order (a buffer is read only after its wait)
        self._posted: Dict[int, Deque[Tuple[Message, dist.Work, torch.Tensor]]] = {q: deque() for q in self._queues}

    def send(self, message: Message, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` as ``message`` to pipeline rank ``dst`` without waiting."""
        check_spec(tensor, self.spec_of(message), _what(message))
        if dst in self.schedule.downstream:  # nothing will prove them received: one in flight at a time
            self._release([m for m, (_, _, to) in self._pending.items() if to == dst])
        t = tensor.detach().contiguous()
        self._pending[message] = (dist.isend(t, self.ps.peer(dst)), t, dst)  # t lives until the send is done

    def post(self, message: Message, src: int) -> None:
        """Post, without waiting, the receives of ``src``'s messages up to ``message`` (those
        ``recv(message, src)`` would take): they arrive while this rank computes."""
        posted = self._posted.get(src, ())
        if message in self._early or any(m == message for m, _, _ in posted):
            return
        for arrived in self._queues.get(src, ()):
            t = self._buffer(arrived)
            posted.append((arrived, dist.irecv(t, self.ps.peer(src)), t))
            if arrived == message:
                return
        raise self._never_sent(message, src)

    def recv(self, message: Message, src: int) -> torch.Tensor:
        """``message`` from pipeline rank ``src``: receives ``src``'s messages in its order until it comes."""
        if message in self._early:
            return self._early.pop(message)
        for arrived, t in self._arrivals(src):
            self._release(self.schedule.acknowledges.get(arrived, ()))
            if arrived == message:
                return t
            self._early[arrived] = t
        raise self._never_sent(message, src)

    def _arrivals(self, src: int) -> Iterator[Tuple[Message, torch.Tensor]]:
        """``src``'s next messages, received: first those posted ahead, then the rest of its queue."""
        posted = self._posted.get(src, deque())
        while posted:
            arrived, work, t = posted.popleft()
            work.wait()
            yield arrived, t
        for arrived in self._queues.get(src, ()):
            t = self._buffer(arrived)
            dist.recv(t, self.ps.peer(src))
            yield arrived, t

    def _buffer(self, message: Message) -> torch.Tensor:
        shape, dtype = self.spec_of(message)
        return torch.empty(shape, dtype=dtype, device=self.ps.device)

    def _never_sent(self, message: Message, src: int) -> RuntimeError:
        return RuntimeError(
            f"pipeline p2p: pipeline rank {self.ps.pp_rank} waits for {message} from pipeline "
            f"rank {src}, whose schedule does not send it"
        )

    def _release(self, received: Sequence[Message]) -> None:
        """Complete the sends the peer has received and drop their buffers (their memory is free)."""
        for message in received:
            work, _, _ = self._pending.pop(message)
            work.wait()

    def wait(self) -> None:
        """Complete every send issued so far (call before the tensors may be reused)."""
        self._release(list(self._pending))
