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
- ``forward_backward_gpipe``: all forwards, then all backwards (holds m activations);
- ``forward_backward_1f1b``: PipeDream-flush — stage s runs P-s-1 warm-up forwards, then
  alternates one forward and one backward, then drains (holds at most P-s activations);
- ``forward_backward_pipelining_with_interleaving``: Megatron-LM's interleaved 1F1B over the
  v model chunks of each rank (``order.py`` has the order of every schedule).

Memory is bounded by the schedule, not by m: a stage output is freed as soon as it is sent
(``deallocate_output``, its graph kept for the backward, which ``backward_from`` runs from the
output's grad_fn), sent buffers are released when their send completes (``p2p.py``), and a
received activation and its gradient go with the micro-batch's backward.

They return, on the last stage, this DP rank's share of the global token mean (its masked
sum / the global count: the DP ranks' shares add up to the mean, which
``training.reduce_loss`` takes to every rank) and None elsewhere. ``on_backward_scale``, when
given, is called with ``loss_scale / m`` before the first backward: losses that enter
backward inside the model (MoE router losses) are averaged over micro-batches with it, as in
Megatron-LM. ``get_forward_backward_func`` picks a schedule.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, List, Optional, Tuple

import torch

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


def forward_backward_no_pipelining(model, microbatches: List[dict], ps: ParallelState, *,
                                   loss_scale: float = 1.0,
                                   forward_only: bool = False, stats: Optional[dict] = None,
                                   on_backward_scale: BackwardScaleHook = None) -> torch.Tensor:
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
        tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class _StageSteps:
    """Runs one op — the forward or backward of a (micro-batch, model chunk) — on this rank,
    with the transfers ``order.input_of`` and ``order.sent_by`` name for it."""

    def __init__(self, model, microbatches: List[dict], ps: ParallelState, chunks: int, link: StageLink,
                 loss: Optional[TokenMeanLoss], timer: _BusyTimer, forward_only: bool):
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
def _rank_schedule(schedule: str, pp: int, chunks: int, microbatches: int, rank: int,
                   forward_only: bool) -> Tuple[Tuple[Op, ...], Transfers]:
    """This rank's ops and what its link knows of the step; every step of a run (and every
    evaluation) has the same, so it is worked out once (seconds at P=16, v=4, m=256)."""
    all_ops = [pipeline_ops(schedule, pp, chunks, microbatches, r, forward_only) for r in range(pp)]
    return tuple(all_ops[rank]), transfers(all_ops, pp, chunks, rank)


def _pipelined(model, microbatches: List[dict], ps: ParallelState, *, schedule: str, chunks: int,
               loss_scale: float, forward_only: bool, stats: Optional[dict],
               on_backward_scale: BackwardScaleHook, overlap_p2p_comm: bool) -> Optional[torch.Tensor]:
    """Run this rank's ops of ``schedule`` (``order.pipeline_ops``) over ``chunks`` model chunks;
    with ``overlap_p2p_comm`` each op's receives are posted while the op before it computes."""
    n = len(microbatches)
    if n == 0:
        raise ValueError("a pipelined step needs at least one micro-batch")
    held = getattr(model, "num_model_chunks", 1)
    if held != chunks:
        raise ValueError(f"the model holds {held} model chunks per pipeline rank, the schedule runs {chunks}: "
                         "pass num_model_chunks=plan.num_model_chunks to get_forward_backward_func")
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


def forward_backward_gpipe(model, microbatches: List[dict], ps: ParallelState, *,
                           loss_scale: float = 1.0,
                           forward_only: bool = False, stats: Optional[dict] = None,
                           on_backward_scale: BackwardScaleHook = None,
                           overlap_p2p_comm: bool = False) -> Optional[torch.Tensor]:
    """All forwards, then all backwards."""
    return _pipelined(model, microbatches, ps, schedule="gpipe", chunks=1, loss_scale=loss_scale,
                      forward_only=forward_only, stats=stats, on_backward_scale=on_backward_scale,
                      overlap_p2p_comm=overlap_p2p_comm)


def forward_backward_1f1b(model, microbatches: List[dict], ps: ParallelState, *,
                          loss_scale: float = 1.0,
                          forward_only: bool = False, stats: Optional[dict] = None,
                          on_backward_scale: BackwardScaleHook = None,
                          overlap_p2p_comm: bool = False) -> Optional[torch.Tensor]:
    """One-forward-one-backward (PipeDream-flush); works with fewer micro-batches than stages."""
    return _pipelined(model, microbatches, ps, schedule="1f1b", chunks=1, loss_scale=loss_scale,
                      forward_only=forward_only, stats=stats, on_backward_scale=on_backward_scale,
                      overlap_p2p_comm=overlap_p2p_comm)


def forward_backward_pipelining_with_interleaving(model, microbatches: List[dict], ps: ParallelState, *,
                                                  loss_scale: float = 1.0,
                                                  forward_only: bool = False, stats: Optional[dict] = None,
                                                  on_backward_scale: BackwardScaleHook = None,
                                                  overlap_p2p_comm: bool = False) -> Optional[torch.Tensor]:
    """Interleaved 1F1B over the model's ``num_model_chunks`` chunks (``order.py``); any number
    of micro-batches."""
    return _pipelined(model, microbatches, ps, schedule="1f1b", chunks=model.num_model_chunks,
                      loss_scale=loss_scale, forward_only=forward_only, stats=stats,
                      on_backward_scale=on_backward_scale, overlap_p2p_comm=overlap_p2p_comm)


SCHEDULES = {"1f1b": forward_backward_1f1b, "gpipe": forward_backward_gpipe}


def get_forward_backward_func(ps: ParallelState, schedule: str = "1f1b", *, num_model_chunks: int = 1,
                              overlap_p2p_comm: bool = False, overlap_moe_comm: bool = False) -> Callable:
    """The schedule of ``--pipeline-schedule`` for this layout; with ``num_model_chunks`` > 1
    (``ParallelPlan.num_model_chunks``: interleaving) the interleaved 1F1B schedule, whose
    receives ``overlap_p2p_comm`` (``--overlap-p2p-communication``) posts one op ahead: as in
    Megatron-LM, only the interleaved schedule overlaps. ``overlap_moe_comm``
    (``--overlap-moe-expert-parallel-comm``, training steps) overlaps the expert all-to-alls in
    the combined 1F1B schedule (``a2a_pipelined.py``: 1F1B, interleaved or not, or one stage)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule {schedule!r}: expected one of {sorted(SCHEDULES)}")
    if overlap_moe_comm:
        if ps.pp_size > 1 and schedule != "1f1b":
            raise ValueError(f"--overlap-moe-expert-parallel-comm with pipeline parallelism runs the combined 1F1B "
                             f"schedule: it needs --pipeline-schedule 1f1b (have {schedule})")
        return forward_backward_combined_1f1b
    if num_model_chunks > 1:
        if ps.pp_size == 1 or schedule != "1f1b":
            raise ValueError(f"{num_model_chunks} model chunks per rank need the interleaved 1F1B schedule: "
                             f"--pipeline-schedule 1f1b and --pipeline-model-parallel-size > 1 (have "
                             f"{schedule}, {ps.pp_size})")
        interleaved = forward_backward_pipelining_with_interleaving
        return functools.partial(interleaved, overlap_p2p_comm=True) if overlap_p2p_comm else interleaved
    return forward_backward_no_pipelining if ps.pp_size == 1 else SCHEDULES[schedule]
