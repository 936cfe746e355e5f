"""Forward/backward schedules over the micro-batches of one optimizer step.

All schedules compute the same gradients: each micro-batch's loss is the masked mean over
its tokens, scaled by ``loss_scale / num_microbatches`` before backward, so accumulated
gradients are those of the mean loss (averaged over DP afterwards by ``finalize_grads``,
which also sums the replicas held by several stages). Every schedule back-propagates the
micro-batches in the order it ran them, so GPipe and 1F1B accumulate in the same order and
give bitwise equal gradients (equal to no-pipelining up to the order of cross-stage sums).

- ``forward_backward_no_pipelining``: gradient accumulation on one stage (PP=1);
- ``forward_backward_gpipe``: all forwards, then all backwards (holds m activations);
- ``forward_backward_1f1b``: PipeDream-flush — stage s runs P-s-1 warm-up forwards, then
  alternates one forward and one backward, then drains (holds at most P-s activations).

The pipelined schedules return the mean loss on the last stage and None elsewhere
(``training.reduce_loss`` takes it from there). ``get_forward_backward_func`` picks one.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Callable, List, Optional

import torch

from megatron_p2r.moe import aux_loss
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.p2p import StageLink


def masked_mean(token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.to(token_loss.dtype)
    return (token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def autocast_context(ps: ParallelState, dtype: Optional[torch.dtype]):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=ps.device.type, dtype=dtype)


class _BusyTimer:
    """Wall time spent computing (not waiting on neighbours); only when stats are asked for."""

    def __init__(self, stats: Optional[dict], device: torch.device):
        self.stats, self.device = stats, device
        if stats is not None:
            stats.update(busy_s=0.0, peak_inflight=0)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def busy(self):
        if self.stats is None:
            yield
            return
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.stats["busy_s"] += time.perf_counter() - start

    def inflight(self, count: int) -> None:
        if self.stats is not None:
            self.stats["peak_inflight"] = max(self.stats["peak_inflight"], count)


def forward_backward_no_pipelining(model, microbatches: List[dict], ps: ParallelState, *,
                                   loss_scale: float = 1.0, dtype: Optional[torch.dtype] = None,
                                   forward_only: bool = False, stats: Optional[dict] = None) -> torch.Tensor:
    """Gradient accumulation on one stage; returns the mean loss over micro-batches (detached).
    ``stats`` (optional dict, every schedule) receives busy_s and peak_inflight."""
    n = len(microbatches)
    aux_loss.set_backward_scale(loss_scale / n)
    timer = _BusyTimer(stats, ps.device)
    total = torch.zeros((), device=ps.device)
    for mb in microbatches:
        with timer.busy():
            with autocast_context(ps, dtype), (torch.no_grad() if forward_only else contextlib.nullcontext()):
                loss = masked_mean(model(tokens=mb["tokens"], labels=mb["labels"]), mb["loss_mask"])
            if not forward_only:
                (loss * (loss_scale / n)).backward()
        timer.inflight(0 if forward_only else 1)
        total += loss.detach().float()
    return total / n


def _pipelined(model, microbatches: List[dict], ps: ParallelState, *, loss_scale: float,
               dtype: Optional[torch.dtype], forward_only: bool, warmup_forwards: int,
               stats: Optional[dict]) -> Optional[torch.Tensor]:
    """Run ``warmup_forwards`` forwards, then one forward + one backward per remaining
    micro-batch, then the outstanding backwards. GPipe is warm-up = m, 1F1B warm-up = P-s-1."""
    n = len(microbatches)
    if n == 0:
        raise ValueError("a pipelined step needs at least one micro-batch")
    aux_loss.set_backward_scale(loss_scale / n)
    link, timer = StageLink(ps), _BusyTimer(stats, ps.device)
    inflight = deque()  # (received input, output) of micro-batches awaiting backward
    total = torch.zeros((), device=ps.device) if ps.is_last_stage else None
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()

    def forward(mb: dict) -> None:
        x = link.recv_forward(requires_grad=not forward_only)
        with timer.busy(), grad_mode, autocast_context(ps, dtype):
            labels = mb["labels"] if ps.is_last_stage else None
            out = model(tokens=mb["tokens"], labels=labels) if x is None else model(hidden=x, labels=labels)
            if ps.is_last_stage:
                out = masked_mean(out, mb["loss_mask"])
        if ps.is_last_stage:
            total.add_(out.detach().float())
        else:
            link.send_forward(out)
        if not forward_only:
            inflight.append((x, out))
            timer.inflight(len(inflight))

    def backward() -> None:
        x, out = inflight.popleft()
        grad = link.recv_backward()
        with timer.busy():
            if grad is None:  # last stage: the loss itself
                (out * (loss_scale / n)).backward()
            else:
                torch.autograd.backward(out, grad_tensors=grad)
        link.send_backward(None if x is None else x.grad)

    warmup = n if forward_only else min(warmup_forwards, n)
    for mb in microbatches[:warmup]:
        forward(mb)
    for mb in microbatches[warmup:]:
        forward(mb)
        backward()
    while inflight:
        backward()
    link.wait()
    return None if total is None else total / n


def forward_backward_gpipe(model, microbatches: List[dict], ps: ParallelState, *,
                           loss_scale: float = 1.0, dtype: Optional[torch.dtype] = None,
                           forward_only: bool = False, stats: Optional[dict] = None) -> Optional[torch.Tensor]:
    """All forwards, then all backwards."""
    return _pipelined(model, microbatches, ps, loss_scale=loss_scale, dtype=dtype, forward_only=forward_only,
                      warmup_forwards=len(microbatches), stats=stats)


def forward_backward_1f1b(model, microbatches: List[dict], ps: ParallelState, *,
                          loss_scale: float = 1.0, dtype: Optional[torch.dtype] = None,
                          forward_only: bool = False, stats: Optional[dict] = None) -> Optional[torch.Tensor]:
    """One-forward-one-backward (PipeDream-flush); works with fewer micro-batches than stages."""
    return _pipelined(model, microbatches, ps, loss_scale=loss_scale, dtype=dtype, forward_only=forward_only,
                      warmup_forwards=ps.pp_size - ps.pp_rank - 1, stats=stats)


SCHEDULES = {"1f1b": forward_backward_1f1b, "gpipe": forward_backward_gpipe}


def get_forward_backward_func(ps: ParallelState, schedule: str = "1f1b") -> Callable:
    if ps.pp_size == 1:
        return forward_backward_no_pipelining
    if schedule not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule {schedule!r}: expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[schedule]
