"""Forward/backward schedules over the micro-batches of one optimizer step.

The loss is the mean over the global batch's valid tokens, as Megatron-LM and torchtitan
normalise it: sum over every micro-batch of every DP rank of (token loss x loss mask),
divided by the sum of the loss masks over that whole global batch. The stage that computes
the loss counts the valid tokens of its micro-batches before the first forward (the masks
are known up front) and all-reduces that one number over DP (a device tensor: no host
sync). The model returns a micro-batch's masked sum itself when given the loss mask (its
fused loss computes the gradient along: parallel/cross_entropy.py). Each micro-batch's
backward runs on ``masked sum x loss_scale x DP / valid tokens``:
``finalize_grads`` then averages over DP (and sums the replicas held by several stages), so
the gradient is that of the global token mean whatever the masks and micro-batch shapes.
Every schedule back-propagates the micro-batches in the order it ran them, so GPipe and 1F1B
accumulate in the same order and give bitwise equal gradients (equal to no-pipelining up to
the order of cross-stage sums).

- ``forward_backward_no_pipelining``: gradient accumulation on one stage (PP=1);
- ``forward_backward_gpipe``: all forwards, then all backwards (holds m activations);
- ``forward_backward_1f1b``: PipeDream-flush — stage s runs P-s-1 warm-up forwards, then
  alternates one forward and one backward, then drains (holds at most P-s activations).

They return, on the last stage, this DP rank's share of the global token mean (its masked
sum / the global count: the DP ranks' shares add up to the mean, which
``training.reduce_loss`` takes to every rank) and None elsewhere. ``on_backward_scale``, when
given, is called with ``loss_scale / m`` before the first backward: losses that enter
backward inside the model (MoE router losses) are averaged over micro-batches with it, as in
Megatron-LM. ``get_forward_backward_func`` picks a schedule.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.p2p import StageLink

BackwardScaleHook = Optional[Callable[[float], None]]


def global_valid_tokens(microbatches: List[dict], ps: ParallelState) -> torch.Tensor:
    """Sum of the loss masks of this step's micro-batches over all DP ranks (float64: exact
    counts), at least 1. One all-reduce of a scalar on the device, no host synchronisation."""
    count = torch.zeros((), dtype=torch.float64, device=ps.device)
    for mb in microbatches:
        count += mb["loss_mask"].sum(dtype=torch.float64)
    if ps.group("dp") is not None:
        dist.all_reduce(count, group=ps.group("dp"))
    return count.clamp(min=1.0)


class TokenMeanLoss:
    """The loss side of a step on the stage that computes it: masked sums in, backward on
    their share of the global token mean, this rank's share of the mean out."""

    def __init__(self, microbatches: List[dict], ps: ParallelState, loss_scale: float):
        self.tokens = global_valid_tokens(microbatches, ps)
        # x DP: finalize_grads divides the DP sum of the gradients by DP
        self.grad_factor = (loss_scale * ps.dp_size / self.tokens).float()
        self.total = torch.zeros((), device=ps.device)

    def add(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """This micro-batch's masked sum (the model's output given the loss mask; kept in the
        graph for ``backward``)."""
        self.total.add_(loss_sum.detach().float())
        return loss_sum

    def backward(self, loss_sum: torch.Tensor) -> None:
        (loss_sum * self.grad_factor).backward()

    def share(self) -> torch.Tensor:
        return (self.total / self.tokens).float()


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


def _announce_backward_scale(hook: BackwardScaleHook, loss_scale: float, n: int, forward_only: bool) -> None:
    if hook is not None and not forward_only and n:
        hook(loss_scale / n)


def forward_backward_no_pipelining(model, microbatches: List[dict], ps: ParallelState, *,
                                   loss_scale: float = 1.0, dtype: Optional[torch.dtype] = None,
                                   forward_only: bool = False, stats: Optional[dict] = None,
                                   on_backward_scale: BackwardScaleHook = None) -> torch.Tensor:
    """Gradient accumulation on one stage; returns this DP rank's share of the token mean
    (detached). ``stats`` (optional dict, every schedule) receives busy_s and peak_inflight."""
    _announce_backward_scale(on_backward_scale, loss_scale, len(microbatches), forward_only)
    timer = _BusyTimer(stats, ps.device)
    loss = TokenMeanLoss(microbatches, ps, loss_scale)
    for mb in microbatches:
        with timer.busy():
            with autocast_context(ps, dtype), (torch.no_grad() if forward_only else contextlib.nullcontext()):
                loss_sum = loss.add(model(tokens=mb["tokens"], labels=mb["labels"], loss_mask=mb["loss_mask"]))
            if not forward_only:
                loss.backward(loss_sum)
        timer.inflight(0 if forward_only else 1)
    return loss.share()


def _pipelined(model, microbatches: List[dict], ps: ParallelState, *, loss_scale: float,
               dtype: Optional[torch.dtype], forward_only: bool, warmup_forwards: int,
               stats: Optional[dict], on_backward_scale: BackwardScaleHook) -> Optional[torch.Tensor]:
    """Run ``warmup_forwards`` forwards, then one forward + one backward per remaining
    micro-batch, then the outstanding backwards. GPipe is warm-up = m, 1F1B warm-up = P-s-1."""
    n = len(microbatches)
    if n == 0:
        raise ValueError("a pipelined step needs at least one micro-batch")
    _announce_backward_scale(on_backward_scale, loss_scale, n, forward_only)
    link, timer = StageLink(ps), _BusyTimer(stats, ps.device)
    loss = TokenMeanLoss(microbatches, ps, loss_scale) if ps.is_last_stage else None
    inflight = deque()  # (hidden spec, received input, output) of micro-batches awaiting backward
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()

    def forward(mb: dict) -> None:
        spec = model.hidden_spec(tuple(mb["tokens"].shape))
        x = link.recv_forward(spec, requires_grad=not forward_only)
        with timer.busy(), grad_mode, autocast_context(ps, dtype):
            last = {"labels": mb["labels"], "loss_mask": mb["loss_mask"]} if ps.is_last_stage else {}
            out = model(tokens=mb["tokens"], **last) if x is None else model(hidden=x, **last)
            if loss is not None:
                out = loss.add(out)
        if loss is None:
            link.send_forward(out, spec)
        if not forward_only:
            inflight.append((spec, x, out))
            timer.inflight(len(inflight))

    def backward() -> None:
        spec, x, out = inflight.popleft()
        grad = link.recv_backward(spec)
        with timer.busy():
            if grad is None:  # last stage: the loss itself
                loss.backward(out)
            else:
                torch.autograd.backward(out, grad_tensors=grad)
        link.send_backward(None if x is None else x.grad, spec)

    warmup = n if forward_only else min(warmup_forwards, n)
    for mb in microbatches[:warmup]:
        forward(mb)
    for mb in microbatches[warmup:]:
        forward(mb)
        backward()
    while inflight:
        backward()
    link.wait()
    return None if loss is None else loss.share()


def forward_backward_gpipe(model, microbatches: List[dict], ps: ParallelState, *,
                           loss_scale: float = 1.0, dtype: Optional[torch.dtype] = None,
                           forward_only: bool = False, stats: Optional[dict] = None,
                           on_backward_scale: BackwardScaleHook = None) -> Optional[torch.Tensor]:
    """All forwards, then all backwards."""
    return _pipelined(model, microbatches, ps, loss_scale=loss_scale, dtype=dtype, forward_only=forward_only,
                      warmup_forwards=len(microbatches), stats=stats, on_backward_scale=on_backward_scale)


def forward_backward_1f1b(model, microbatches: List[dict], ps: ParallelState, *,
                          loss_scale: float = 1.0, dtype: Optional[torch.dtype] = None,
                          forward_only: bool = False, stats: Optional[dict] = None,
                          on_backward_scale: BackwardScaleHook = None) -> Optional[torch.Tensor]:
    """One-forward-one-backward (PipeDream-flush); works with fewer micro-batches than stages."""
    return _pipelined(model, microbatches, ps, loss_scale=loss_scale, dtype=dtype, forward_only=forward_only,
                      warmup_forwards=ps.pp_size - ps.pp_rank - 1, stats=stats, on_backward_scale=on_backward_scale)


SCHEDULES = {"1f1b": forward_backward_1f1b, "gpipe": forward_backward_gpipe}


def get_forward_backward_func(ps: ParallelState, schedule: str = "1f1b") -> Callable:
    if ps.pp_size == 1:
        return forward_backward_no_pipelining
    if schedule not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule {schedule!r}: expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[schedule]
