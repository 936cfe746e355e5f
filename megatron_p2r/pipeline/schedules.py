"""Forward/backward schedules over the micro-batches of one optimizer step.

The loss is the mean over the global batch's valid tokens (``token_loss.py``).
Every schedule back-propagates each model chunk's micro-batches in the order it ran them, so
GPipe, 1F1B and interleaved 1F1B accumulate every parameter's gradient in the same order and
give bitwise equal gradients (equal to no-pipelining up to the order of cross-stage sums; a
pseudo slot called by two chunks of a rank accumulates their contributions in schedule order).

- ``forward_backward_no_pipelining``: gradient accumulation on one stage (PP=1);
  ``a2a_pipelined.forward_backward_combined_1f1b`` the 1F1B schedule (or, on one stage, that)
  with the expert all-to-alls of one micro-batch overlapped with another's compute
  (--overlap-moe-expert-parallel-comm);
- the pipelined schedules (``_pipelined`` over ``order.pipeline_ops``): GPipe (all forwards,
  then all backwards: holds m activations); 1F1B, PipeDream-flush (stage s runs P-s-1 warm-up
  forwards, then alternates one forward and one backward, then drains: holds at most P-s
  activations); Megatron-LM's interleaved 1F1B over the v model chunks of each rank.

Memory is bounded by the schedule, not by m: a stage output is freed as soon as it is sent
(``deallocate_output``, its graph kept for the backward, which ``backward_from`` runs from the
output's grad_fn), sent buffers are released when their send completes (``p2p.py``), and a
received activation and its gradient go with the micro-batch's backward.

They return, on the last stage, this DP rank's share of the global token mean (its masked
sum / the global count: the DP ranks' shares add up to the mean, which
``training.reduce_loss`` takes to every rank) and None elsewhere. ``on_backward_scale``, when
given, is called with ``loss_scale / m`` before the first backward: losses that enter
backward inside the model (MoE router losses) are averaged over micro-batches with it, as in
Megatron-LM. ``get_forward_backward_func`` gives the function of the schedule the config chose
(``config/schedule.py``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, List, Optional, Tuple

import torch

from megatron_p2r.config.schedule import COMBINED, NO_PIPELINING, SchedulePlan
from megatron_p2r.parallel.state import ParallelState
from megatron_p2r.pipeline.a2a_pipelined import forward_backward_combined_1f1b
from megatron_p2r.pipeline.order import FORWARD, Op, input_of, pipeline_ops, sent_by
from megatron_p2r.pipeline.p2p import StageLink, deallocate_output
from megatron_p2r.pipeline.token_loss import BackwardScaleHook, TokenMeanLoss, announce_backward_scale
from megatron_p2r.pipeline.transfers import Transfers, transfers


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


def forward_backward_no_pipelining(
    model,
    microbatches: List[dict],
    ps: ParallelState,
    *,
    loss_scale: float = 1.0,
    forward_only: bool = False,
    stats: Optional[dict] = None,
    on_backward_scale: BackwardScaleHook = None,
) -> torch.Tensor:
    """Gradient accumulation on one stage; returns this DP rank's share of the token mean
    (detached). ``stats`` (optional dict, every schedule) receives busy_s and peak_inflight."""
    announce_backward_scale(on_backward_scale, loss_scale, len(microbatches), forward_only)
    timer = _BusyTimer(stats, ps.device)
    loss = TokenMeanLoss(microbatches, ps, loss_scale)
    for mb in microbatches:
        with timer.busy():
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                loss_sum = loss.add(model(tokens=mb["tokens"], labels=mb["labels"], loss_mask=mb["loss_mask"]))
            if not forward_only:
                loss.backward(loss_sum)
        timer.inflight(0 if forward_only else 1)
    return loss.share()


def backward_from(out: torch.Tensor, grad: torch.Tensor) -> None:
    """Back-propagate ``grad`` from ``out``, whose data ``deallocate_output`` freed: the autograd
    engine is called on the output's grad_fn directly, as ``torch.autograd.backward`` would
    after checking ``grad``'s shape against the (now one-element) data."""
    torch.autograd.Variable._execution_engine.run_backward(  # the engine behind torch.autograd.backward
        tensors=(out,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class _StageSteps:
    """Runs one op — the forward or backward of a (micro-batch, model chunk) — on this rank,
    with the transfers ``order.input_of`` and ``order.sent_by`` name for it."""

    def __init__(
        self,
        model,
        microbatches: List[dict],
        ps: ParallelState,
        chunks: int,
        link: StageLink,
        loss: Optional[TokenMeanLoss],
        timer: _BusyTimer,
        forward_only: bool,
    ):
        self.model, self.microbatches, self.ps, self.link, self.loss = model, microbatches, ps, link, loss
        self.timer, self.forward_only, self.chunks = timer, forward_only, chunks
        self.inflight = {}  # (micro-batch, chunk) -> (received input, output) awaiting backward

    def run(self, op: Op, post_ahead: Optional[Op] = None) -> None:
        """Run ``op``; with ``post_ahead`` (the next op, when p2p overlaps compute), post that
        op's receives before computing this one."""
        wanted = input_of(op, self.ps.pp_size, self.chunks, self.ps.pp_rank)
        received = None if wanted is None else self.link.recv(*wanted)
        ahead = None if post_ahead is None else input_of(post_ahead, self.ps.pp_size, self.chunks, self.ps.pp_rank)
        if ahead is not None:
            self.link.post(*ahead)
        result = (self._forward if op.kind == FORWARD else self._backward)(op, received)
        for dst, message in sent_by(op, self.ps.pp_size, self.chunks, self.ps.pp_rank):
            self.link.send(message, result, dst)
            if op.kind == FORWARD and not self.forward_only:
                deallocate_output(result)

    def _forward(self, op: Op, x: Optional[torch.Tensor]) -> torch.Tensor:
        """The chunk's output (its loss's masked sum on the last virtual stage)."""
        mb, last = self.microbatches[op.microbatch], self.loss is not None and op.chunk == self.chunks - 1
        if x is not None:
            x.requires_grad_(not self.forward_only)
        grad_mode = torch.no_grad() if self.forward_only else contextlib.nullcontext()
        with self.timer.busy(), grad_mode:
            inputs = dict(tokens=mb["tokens"]) if x is None else dict(hidden=x)
            if last:
                inputs.update(labels=mb["labels"], loss_mask=mb["loss_mask"])
            out = self.model(**inputs, chunk=op.chunk)
            if last:
                out = self.loss.add(out)
        if not self.forward_only:
            self.inflight[(op.microbatch, op.chunk)] = (x, out)
            self.timer.inflight(len(self.inflight))
        return out

    def _backward(self, op: Op, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The gradient of the chunk's input (None on the first virtual stage)."""
        x, out = self.inflight.pop((op.microbatch, op.chunk))
        with self.timer.busy():
            if grad is None:  # the last virtual stage: the loss itself
                self.loss.backward(out)
            else:
                backward_from(out, grad)
        return None if x is None else x.grad


@functools.lru_cache(maxsize=8)
def _rank_schedule(
    schedule: str, pp: int, chunks: int, microbatches: int, rank: int, forward_only: bool
) -> Tuple[Tuple[Op, ...], Transfers]:
    """This rank's ops and what its link knows of the step; every step of a run (and every
    evaluation) has the same, so it is worked out once (seconds at P=16, v=4, m=256)."""
    all_ops = [pipeline_ops(schedule, pp, chunks, microbatches, r, forward_only) for r in range(pp)]
    return tuple(all_ops[rank]), transfers(all_ops, pp, chunks, rank)


def _pipelined(
    model,
    microbatches: List[dict],
    ps: ParallelState,
    *,
    schedule: str,
    chunks: int,
    overlap_p2p_comm: bool,
    loss_scale: float = 1.0,
    forward_only: bool = False,
    stats: Optional[dict] = None,
    on_backward_scale: BackwardScaleHook = None,
) -> Optional[torch.Tensor]:
    """Run this rank's ops of ``schedule`` (``order.pipeline_ops``) over ``chunks`` model chunks;
    with ``overlap_p2p_comm`` each op's receives are posted while the op before it computes."""
    n = len(microbatches)
    if n == 0:
        raise ValueError("a pipelined step needs at least one micro-batch")
    held = getattr(model, "num_model_chunks", 1)
    if held != chunks:
        raise ValueError(
            f"the model holds {held} model chunks per pipeline rank, the schedule runs {chunks}: "
            "build the schedule from the model's plan (ParallelPlan.schedule)"
        )
    announce_backward_scale(on_backward_scale, loss_scale, n, forward_only)
    ops, known = _rank_schedule(schedule, ps.pp_size, chunks, n, ps.pp_rank, forward_only)
    specs = [model.hidden_spec(tuple(mb["tokens"].shape)) for mb in microbatches]
    link = StageLink(ps, known, lambda msg: specs[msg.microbatch])
    loss = TokenMeanLoss(microbatches, ps, loss_scale) if ps.is_last_stage else None
    steps = _StageSteps(model, microbatches, ps, chunks, link, loss, _BusyTimer(stats, ps.device), forward_only)
    for i, op in enumerate(ops):
        steps.run(op, ops[i + 1] if overlap_p2p_comm and i + 1 < len(ops) else None)
    link.wait()
    return None if loss is None else loss.share()


def get_forward_backward_func(schedule: SchedulePlan) -> Callable:
    """The forward/backward function of ``schedule`` (``ParallelPlan.schedule``, or its
    ``serial`` one for forward-only steps): called as ``fn(model, microbatches, ps, *, loss_scale,
    forward_only, stats, on_backward_scale)``."""
    if schedule.kind == NO_PIPELINING:
        return forward_backward_no_pipelining
    if schedule.kind == COMBINED:
        return forward_backward_combined_1f1b
    return functools.partial(
        _pipelined, schedule=schedule.order, chunks=schedule.chunks, overlap_p2p_comm=schedule.posts_receives_ahead
    )
