"""Data-parallel gradient reduction with megatron-core's semantics (``DistributedDataParallel``),
attached to a built stage without wrapping its forward.

- Every parameter's gradient accumulates, micro-batch after micro-batch, into
  ``param.main_grad``: a view into its reduction group's buffer (``grad_buffer.py``, laid out by
  the plan; fp32, or bf16 with ``--main-grads-dtype bf16``), added by a hook that runs once
  autograd has produced ``param.grad``, which is then dropped. So 16-bit compute accumulates in
  fp32 by default, no gradient is copied at reduction time, and no ``.grad`` outlives its
  layer's backward.
- ``--overlap-grad-reduce``: in the last micro-batch's backward (the stage's output marks where
  each backward starts), a bucket's collective starts as soon as every gradient in it is final.
  With interleaving each model chunk has its last micro-batch's backward, chunk v-1's first and
  chunk 0's last (``pipeline.order``); a parameter is final in the last of those among the chunks
  that use it (a pseudo slot may serve several chunks of a rank).
  Buckets of one group start in bucket order on every member — their collectives must line up
  — so a bucket that is not ready holds back those after it; staged buckets (host-resident, see
  ``grad_buffer.py``) are reduced after backward. ``finish_grad_sync`` starts what is left,
  waits, and divides by the DP size (expert gradients too: docs/moe.md).
- ``reduction_started`` (given when built: the host step that starts during backward, through
  its ``HostStepLink``, ``optim/host_step.py``) is told of each bucket once its reduction has
  started, in backward where the bucket is final then (with ``--overlap-grad-reduce``, or with
  nothing to reduce), otherwise in ``finish_grad_sync``; ``finish_grad_reduce`` of that bucket
  then makes its gradients final.
- Under the distributed optimizer ``start_param_sync`` all-gathers the updated shards; with
  ``--overlap-param-gather`` asynchronously, each module's forward waiting for its own buckets
  (a compiled layer's forward for all of its buckets; buckets of layers whose weights are fetched
  from host are gathered before returning).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch import nn

from megatron_p2r.layout.plan import ParallelPlan, Reduction
from megatron_p2r.parallel.grad_buffer import DTYPES, BucketState, ParamAndGradBuffer
from megatron_p2r.parallel.state import ParallelState


class DistributedDataParallel:
    """The gradient buffers of ``model`` (this rank's stage of ``plan``) and their reduction."""

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        ps: ParallelState,
        *,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        fetched: Iterable[int] = (),
        waits_whole: Iterable[nn.Module] = (),
        reduction_started: Optional[Callable[[BucketState], None]] = None,
    ):
        self.model, self.ps = model, ps
        self.overlap_grad_reduce, self.overlap_param_gather = overlap_grad_reduce, overlap_param_gather
        self._staging: Dict[torch.dtype, torch.Tensor] = {}
        named = dict(model.named_parameters())
        module_keys = {s.name: s.module_key for s in plan.tensors(ps.pp_rank)}
        stage = plan.stage(ps.pp_rank)
        self._final_chunk = {id(p): stage.final_chunk(name, module_keys.get(name)) for name, p in named.items()}
        self.buffers: List[ParamAndGradBuffer] = []
        for layout in plan.grad_buffers(ps.pp_rank):
            missing = [n for n in layout.names if n not in named]
            if missing:
                raise ValueError(f"stage {ps.pp_rank} has no parameter {missing[0]!r} of the plan's gradient buffers")
            group = ps.reduction_group(
                Reduction(kind=layout.over, over=layout.over, stages=layout.stages, tp_block=layout.tp_block)
            )
            self.buffers.append(
                ParamAndGradBuffer(
                    layout,
                    [named.pop(n) for n in layout.names],
                    member=plan.buffer_member(layout, ps.coords),
                    group=group,
                    divisor=ps.dp_size,
                    device=ps.device,
                    staged_everywhere=bool(layout.stages) and plan.buffers.break_at_modules,
                    staging=self.staging,
                    grad_dtype=DTYPES[plan.buffers.main_grads_dtype],
                )
            )
        if named:
            raise ValueError(f"parameters outside the plan's gradient buffers: {sorted(named)}")
        self.bucket_of = {id(p): b for buf in self.buffers for b in buf.buckets for p in b.params}
        self._fetched = set(fetched)  # ids of parameters whose layers copy them from host before forward
        self._issued = [0] * len(self.buffers)
        self._expected: Optional[int] = None
        self._backwards: Dict[int, int] = {}
        self._chunk, self._last_microbatch = 0, False
        self.reduction_started = reduction_started
        self._tracks_buckets = overlap_grad_reduce or reduction_started is not None  # in the last backward
        for p in self.model.parameters():
            p.register_post_accumulate_grad_hook(self._accumulate)
        model.register_forward_hook(self._mark_output, with_kwargs=True)
        if overlap_param_gather:
            self._register_param_waits(list(waits_whole))
        self.zero_grad_buffer()

    # -- micro-batches
    def zero_grad_buffer(self, num_microbatches: Optional[int] = None, keep: Iterable[int] = ()) -> None:
        """Zero the gradients before a step of ``num_microbatches`` micro-batches, each run
        through every model chunk (None: no overlap), but those of the parameters ``keep`` (ids:
        an overlapped host step still reads them and zeroes them itself)."""
        keep = set(keep)
        for buf in self.buffers:
            buf.zero(keep)
        self._issued = [0] * len(self.buffers)
        self._expected, self._backwards, self._last_microbatch = num_microbatches, {}, False

    def _mark_output(self, module, args, kwargs, output) -> None:
        """A hook on the output of a model chunk, the first thing each of its backwards reaches.
        A hook and not a wrapper: the output stays the tensor the model made, so the pipeline can
        free its data once sent (``p2p.deallocate_output`` refuses views)."""
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._output_grad, kwargs.get("chunk", 0)))

    def _output_grad(self, chunk: int, grad: torch.Tensor) -> None:
        self.backward_started(chunk)

    def backward_started(self, chunk: int = 0) -> None:
        count = self._backwards[chunk] = self._backwards.get(chunk, 0) + 1
        if self._expected is not None and count > self._expected:
            raise RuntimeError(
                f"backward pass {count} of model chunk {chunk} in a step prepared for "
                f"{self._expected} micro-batches: call zero_grad_buffer(num_microbatches) before "
                "each step"
            )
        self._chunk, self._last_microbatch = chunk, count == self._expected

    def _accumulate(self, p: nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None
        if not (self._last_microbatch and self._tracks_buckets and self._final_chunk[id(p)] == self._chunk):
            return
        bucket = self.bucket_of[id(p)]
        if id(p) not in bucket.pending:
            raise RuntimeError(
                "a gradient was accumulated twice in the last micro-batch's backward, after its "
                "bucket's reduction may have started"
            )
        bucket.pending.discard(id(p))
        if not bucket.pending:
            self._start_ready(self.buffers.index(bucket.buffer))

    def _start_ready(self, index: int) -> None:
        """Start the ready buckets of buffer ``index`` in bucket order (staged ones wait for the
        end; without --overlap-grad-reduce only a buffer with nothing to reduce starts any)."""
        buf, i = self.buffers[index], self._issued[index]
        if not self.overlap_grad_reduce and buf.group is not None:
            return
        while i < len(buf.buckets) and (buf.buckets[i].staged or not buf.buckets[i].pending):
            if not buf.buckets[i].staged:
                buf.start_grad_reduce(buf.buckets[i], async_op=True)
                if self.reduction_started is not None:
                    self.reduction_started(buf.buckets[i])
            i += 1
        self._issued[index] = i

    def finish_grad_sync(self) -> None:
        """Start every reduction not started yet (in order; staged buckets last), wait, average."""
        late = [bucket for buf in self.buffers for bucket in buf.buckets if not bucket.started]
        for buf in self.buffers:
            for bucket in buf.buckets:
                if not bucket.started and not bucket.staged:
                    buf.start_grad_reduce(bucket, async_op=True)
            for bucket in buf.buckets:
                if not bucket.started:
                    buf.start_grad_reduce(bucket, async_op=False)
        for buf in self.buffers:
            for bucket in buf.buckets:
                buf.finish_grad_reduce(bucket)
        if self.reduction_started is not None:
            for bucket in late:
                self.reduction_started(bucket)

    # -- distributed optimizer: updated weights back to every member
    def start_param_sync(self) -> None:
        """All-gather the updated shards, the buckets of the first layers first."""
        self.finish_param_sync()
        for buf in self.buffers:
            if not buf.layout.sharded:
                continue
            for bucket in reversed(buf.buckets):
                overlap = (
                    self.overlap_param_gather
                    and not bucket.staged
                    and not any(id(p) in self._fetched for p in bucket.params)
                )
                buf.start_param_gather(bucket, async_op=overlap)

    def finish_param_sync(self) -> None:
        for buf in self.buffers:
            for bucket in buf.buckets:
                buf.finish_param_gather(bucket)

    def _register_param_waits(self, whole: List[nn.Module]) -> None:
        """Each module's forward waits for its own parameters' buckets; a module of ``whole`` (a
        compiled layer: a wait inside its compiled forward would break the graph) waits for all of
        its parameters', the modules inside it for none."""
        inside = {id(m) for w in whole for m in w.modules()}
        for module in self.model.modules():
            waits_whole = any(module is w for w in whole)
            if id(module) in inside and not waits_whole:
                continue
            own = [self.bucket_of[id(p)] for p in module.parameters(recurse=waits_whole)]
            if own:
                module.register_forward_pre_hook(functools.partial(self._wait_for, own))

    def _wait_for(self, buckets: List[BucketState], module, inputs) -> None:
        for bucket in buckets:
            bucket.buffer.finish_param_gather(bucket)

    # -- bookkeeping
    def staging(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The shared device staging buffer of ``dtype``, at least ``numel`` elements."""
        t = self._staging.get(dtype)
        if t is None or t.numel() < numel:
            t = self._staging[dtype] = torch.empty(numel, dtype=dtype, device=self.ps.device)
        return t[:numel]

    def buffer_tensors(self, kind: str) -> List[torch.Tensor]:
        """The storage of the gradient ("grads") or distributed-optimizer parameter ("params") buffers."""
        storage = [buf.grad_data if kind == "grads" else buf.param_data for buf in self.buffers]
        second = [b.second_grad for buf in self.buffers for b in buf.buckets if b.second_grad is not None]
        return [t for tensors in storage for t in (tensors or {}).values()] + (second if kind == "grads" else [])
