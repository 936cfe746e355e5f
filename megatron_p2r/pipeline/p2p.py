"""Point-to-point transfers between neighbouring pipeline stages.

Every transfer is one message: the tensor. Both ends know its shape and dtype beforehand —
every stage holds all micro-batches of the step, and a stage's hidden states for a micro-batch
of token shape (b, s) are ``model.hidden_spec((b, s))`` — so the receiver allocates from that
``spec`` and no shape header travels (Megatron-LM does the same from its config, but needs
``--variable-seq-lengths`` and an extra shape exchange when shapes vary; here micro-batches of
different shapes in one step cost nothing extra). The sender checks its tensor against the
same spec, so a stage that produced something else fails loudly instead of sending bytes the
peer would misread.

Sends are non-blocking (``isend``) and their handles are kept until ``wait()`` at the end of
the step; receives block. With sends that never wait on the receiver, any schedule whose
receives follow the order of the peer's sends is deadlock-free, which is why no call here
pairs a send with a receive in one batched operation (``batch_isend_irecv`` has hung on gloo).
Peers are global ranks (``ps.peer``): stage s of this rank's tp and dp coordinates. Works
with gloo (CPU tensors) and NCCL (device tensors).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_p2r.parallel.state import ParallelState

# (shape, dtype) of one transfer, known to both ends.
Spec = Tuple[Tuple[int, ...], torch.dtype]


def check_spec(t: torch.Tensor, spec: Spec, what: str) -> None:
    shape, dtype = spec
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise RuntimeError(f"pipeline p2p: the {what} is {t.dtype} {tuple(t.shape)}, but the peer stage "
                           f"allocates {dtype} {tuple(shape)} (model.hidden_spec) to receive it")


class StageLink:
    """Activations to the next stage and gradients to the previous one, for one step."""

    def __init__(self, ps: ParallelState):
        self.ps = ps
        self._pending: List[Tuple[dist.Work, torch.Tensor]] = []
        self.next_rank = ps.peer(ps.pp_rank + 1) if not ps.is_last_stage else None
        self.prev_rank = ps.peer(ps.pp_rank - 1) if not ps.is_first_stage else None

    def _send(self, t: torch.Tensor, spec: Spec, dst: int, what: str) -> None:
        check_spec(t, spec, what)
        t = t.detach().contiguous()
        self._pending.append((dist.isend(t, dst), t))  # keep the tensor alive until the send is done

    def _recv(self, spec: Spec, src: int) -> torch.Tensor:
        shape, dtype = spec
        t = torch.empty(shape, dtype=dtype, device=self.ps.device)
        dist.recv(t, src)
        return t

    # At the ends of the pipeline these are no-ops (sends) or return None (receives).
    def send_forward(self, activation: torch.Tensor, spec: Spec) -> None:
        if self.next_rank is not None:
            self._send(activation, spec, self.next_rank, "activation to send forward")

    def recv_forward(self, spec: Spec, requires_grad: bool) -> Optional[torch.Tensor]:
        """The previous stage's output, as a leaf whose ``.grad`` backward fills."""
        if self.prev_rank is None:
            return None
        return self._recv(spec, self.prev_rank).requires_grad_(requires_grad)

    def send_backward(self, grad: Optional[torch.Tensor], spec: Spec) -> None:
        if self.prev_rank is not None:
            self._send(grad, spec, self.prev_rank, "gradient to send backward")

    def recv_backward(self, spec: Spec) -> Optional[torch.Tensor]:
        return None if self.next_rank is None else self._recv(spec, self.next_rank)

    def wait(self) -> None:
        """Complete every send issued so far (call before the tensors may be reused)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
