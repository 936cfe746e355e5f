"""Megatron-LM's profiler flags in the training loop (docs/profiling.md).

On each of --profile-ranks, --profile with --use-pytorch-profiler traces steps with
``torch.profiler`` into --tensorboard-dir (TensorBoard's trace handler: TensorBoard and
ui.perfetto.dev open the file); without it, on CUDA, the steps are bracketed for nsys
(``cudaProfilerStart``/``Stop`` and ``emit_nvtx``). --record-memory-history records the CUDA
allocator's history on the last rank and dumps a snapshot at each log interval.

The step window is Megatron-LM's (core_v0.16.1 ``train``), reproduced by building the same
objects at the same places of the loop: the torch profiler starts before the loop with
``schedule(wait=start - 1, warmup=1, active=end - start)`` (no warm-up when start is 0) and is
stepped at the top of every pass, so its trace holds the steps start .. end - 1 of this run
(``ProfilerStep#N`` wraps the step that makes iteration N of a fresh run); the nsys range opens
at the top of the pass that starts at global iteration ``start`` and closes after iteration
``end`` (steps start + 1 .. end). Both stop after iteration ``end``.
"""

from __future__ import annotations

import glob
import os
from typing import Optional

import torch

from megatron_p2r.config import Config
from megatron_p2r.config.profiling import DEFAULT_TRACE_DIR
from megatron_p2r.parallel.state import ParallelState

MEMORY_HISTORY_EVENTS = 100_000  # Megatron-LM keeps the last 100,000 alloc/free events


def _say(rank: int, message: str) -> None:
    print(f"[rank {rank}] {message}", flush=True)


def _last_rank(ps: ParallelState) -> bool:
    """Megatron-LM's ``is_last_rank``: the rank that records and dumps memory history."""
    return ps.rank == ps.layout.world_size - 1


def start_memory_history(cfg: Config, ps: ParallelState) -> None:
    """--record-memory-history: before the model is built (its parameters' allocations are part
    of the history), on the last rank; on CPU one line saying it needs CUDA."""
    if not (cfg.profiling.record_memory_history and _last_rank(ps)):
        return
    if ps.device.type != "cuda":
        _say(ps.rank, "--record-memory-history records the CUDA allocator: it needs CUDA, nothing is recorded on CPU")
        return
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks="all", max_entries=MEMORY_HISTORY_EVENTS
    )


def dump_memory_snapshot(path: str) -> None:
    """The allocator's snapshot (live segments and the recorded history), pickled as
    ``torch.cuda.memory._dump_snapshot`` writes it, under a temporary name renamed when complete."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.tmp"
    torch.cuda.memory._dump_snapshot(partial)
    os.replace(partial, path)


class StepProfiler:
    """The loop's profiling hooks: ``before_step`` at the top of each pass (before the step that
    follows ``iteration``), ``after_step`` after it, ``close`` when the loop ends."""

    def __init__(self, cfg: Config, ps: ParallelState, first_iteration: int):
        p = cfg.profiling
        self.cfg, self.rank, self.first_iteration = cfg, ps.rank, first_iteration
        self.cuda = ps.device.type == "cuda"
        profiled = p.profile and ps.rank in p.profile_ranks
        self.torch_profiler = self._start_torch_profiler(ps) if profiled and p.use_pytorch_profiler else None
        self.nsys = profiled and not p.use_pytorch_profiler and self.cuda
        self.nvtx = None  # the emit_nvtx context while the nsys range is open
        self.dumps_memory = p.record_memory_history and _last_rank(ps) and self.cuda
        if profiled and not p.use_pytorch_profiler and not self.cuda and ps.rank == min(p.profile_ranks):
            _say(
                ps.rank,
                "--profile without --use-pytorch-profiler brackets the steps for nsys (cudaProfilerStart/Stop), "
                "which needs CUDA: nothing is profiled on CPU (add --use-pytorch-profiler for a trace)",
            )

    def _start_torch_profiler(self, ps: ParallelState) -> torch.profiler.profile:
        p = self.cfg.profiling
        directory = self.cfg.logging.tensorboard_dir or DEFAULT_TRACE_DIR
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=max(p.profile_step_start - 1, 0),
                warmup=1 if p.profile_step_start > 0 else 0,
                active=p.profile_step_end - p.profile_step_start,
                repeat=1,
            ),
            on_trace_ready=_TraceWriter(directory, ps.rank),
            record_shapes=True,
            with_stack=True,
        )
        profiler.start()
        return profiler

    def before_step(self, iteration: int) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif self.nsys and iteration == self.cfg.profiling.profile_step_start:
            torch.cuda.profiler.start()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        if iteration == self.cfg.profiling.profile_step_end:
            self._stop()
        log_interval = self.cfg.logging.log_interval
        if self.dumps_memory and (iteration % log_interval == 0 or iteration == self.first_iteration + 1):
            dump_memory_snapshot(self.cfg.profiling.memory_snapshot_path)

    def close(self) -> None:
        """The loop ended (or stopped early) with a window still open: close it."""
        self._stop()

    def _stop(self) -> None:
        if self.torch_profiler is not None:
            # Stopped inside its window (a run that ends early, or a resumed run whose global
            # iteration ``end`` comes first), the trace is written now and the profiler is done:
            # its later steps would close the closed trace. Outside the window stop changes
            # nothing and the profiler steps on, as Megatron-LM's does.
            mid_window = self.torch_profiler.current_action != torch.profiler.ProfilerAction.NONE
            self.torch_profiler.stop()
            if mid_window:
                self.torch_profiler = None
        elif self.nvtx is not None:
            torch.cuda.profiler.stop()
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None


class _TraceWriter:
    """TensorBoard's trace handler (``<dir>/rank<R>.<time>.pt.trace.json``), and one line naming
    the file it wrote."""

    def __init__(self, directory: str, rank: int):
        self.directory, self.rank = directory, rank
        self.handler = torch.profiler.tensorboard_trace_handler(directory, worker_name=f"rank{rank}")

    def __call__(self, profiler: torch.profiler.profile) -> None:
        pattern = os.path.join(self.directory, f"rank{self.rank}.*.pt.trace.json")
        before = set(glob.glob(pattern))
        self.handler(profiler)
        written: Optional[str] = max(set(glob.glob(pattern)) - before, default=None, key=os.path.getmtime)
        _say(self.rank, f"profiler trace written to {written or self.directory} (TensorBoard, ui.perfetto.dev)")
