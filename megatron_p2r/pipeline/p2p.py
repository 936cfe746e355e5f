"""Point-to-point transfers between neighbouring pipeline stages.

Every transfer is two messages: a small int64 header (dtype code, number of dimensions,
shape) and then the tensor. The receiver allocates from the header, so nothing assumes a
micro-batch size, sequence length or compute dtype (fp32, or the autocast dtype).

Sends are non-blocking (``isend``) and their handles are kept until ``wait()`` at the end of
the step; receives block. With sends that never wait on the receiver, any schedule whose
receives follow the order of the peer's sends is deadlock-free, which is why no call here
pairs a send with a receive in one batched operation (``batch_isend_irecv`` has hung on gloo).
Peers are global ranks (``ps.peer``): stage s of this rank's tp and dp coordinates. Works
with gloo (CPU tensors) and NCCL (device tensors, the header included).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_p2r.parallel.state import ParallelState

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS


def encode_header(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in DTYPES:
        raise TypeError(f"pipeline p2p cannot send dtype {t.dtype}; supported: {DTYPES}")
    if t.dim() > MAX_DIMS:
        raise ValueError(f"pipeline p2p sends at most {MAX_DIMS} dimensions, got shape {tuple(t.shape)}")
    header = [DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (MAX_DIMS - t.dim())
    return torch.tensor(header, dtype=torch.int64, device=t.device)


def decode_header(header: torch.Tensor) -> Tuple[torch.dtype, Tuple[int, ...]]:
    values = header.tolist()
    code, ndim = values[0], values[1]
    if not (0 <= code < len(DTYPES) and 0 <= ndim <= MAX_DIMS):
        raise RuntimeError(f"corrupt pipeline p2p header {values}: the peer sent something else")
    return DTYPES[code], tuple(values[2:2 + ndim])


class StageLink:
    """Activations to the next stage and gradients to the previous one, for one step."""

    def __init__(self, ps: ParallelState):
        self.ps = ps
        self._pending: List[Tuple[dist.Work, torch.Tensor]] = []
        self.next_rank = ps.peer(ps.pp_rank + 1) if not ps.is_last_stage else None
        self.prev_rank = ps.peer(ps.pp_rank - 1) if not ps.is_first_stage else None

    def _send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        header = encode_header(t)
        # Keep both tensors alive until the transfer is known to be done.
        self._pending.append((dist.isend(header, dst), header))
        self._pending.append((dist.isend(t, dst), t))

    def _recv(self, src: int) -> torch.Tensor:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.ps.device)
        dist.recv(header, src)
        dtype, shape = decode_header(header)
        t = torch.empty(shape, dtype=dtype, device=self.ps.device)
        dist.recv(t, src)
        return t

    # At the ends of the pipeline these are no-ops (sends) or return None (receives).
    def send_forward(self, activation: torch.Tensor) -> None:
        if self.next_rank is not None:
            self._send(activation, self.next_rank)

    def recv_forward(self, requires_grad: bool) -> Optional[torch.Tensor]:
        """The previous stage's output, as a leaf whose ``.grad`` backward fills."""
        if self.prev_rank is None:
            return None
        return self._recv(self.prev_rank).requires_grad_(requires_grad)

    def send_backward(self, grad: Optional[torch.Tensor]) -> None:
        if self.prev_rank is not None:
            self._send(grad, self.prev_rank)

    def recv_backward(self) -> Optional[torch.Tensor]:
        return None if self.next_rank is None else self._recv(self.next_rank)

    def wait(self) -> None:
        """Complete every send issued so far (call before the tensors may be reused)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
